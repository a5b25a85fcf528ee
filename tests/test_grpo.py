"""Tests for grpo.py: hand-computed numbers, closed-form gradients, random data against stored values, micro-batching,
the non-finite guard and token log-probs on a tiny random Qwen2."""
import contextlib
import copy
import json
import math
import os

import pytest
import torch
from torch.testing import assert_close

from conftest import make_char_tokenizer, make_tiny_causal_lm
from grpo import (build_batch, clipped_surrogate, entropy_from_logprobs, group_advantages, logprobs_and_entropy,
                  loss_normaliser, policy_loss, shaped_offpolicy_loss, token_logprobs, truncated_is_weight, update,
                  warmup_lr)
from harness.engines.trainer import (chunked_logprobs_and_entropy, length_sorted_micro_batches, loss_metrics, padding_share,
                                     sampler_rows)

LN = math.log


# ---------------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    # group of 4, rewards [1, 0, 0, 1]: mean 0.5 -> A = [0.5, -0.5, -0.5, 0.5]
    # unbiased std = sqrt((4 * 0.25) / 3) = 0.5773503 -> A / (std + 1e-6) = ±0.8660239
    # second group [1, 1, 1, 1]: zero variance -> all zero (no NaN, with or without std)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert_close(group_advantages(r, 4), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert_close(group_advantages(r, 4, scale_std=True), torch.tensor([s, -s, -s, s, 0, 0, 0, 0]))


def test_group_advantages_ragged_and_edges():
    """scope.py calls it per group when merge=append makes groups ragged: group_size=len(rewards)."""
    r = [0.0, 1.0, 1.0]  # a list and a group of 3: mean 2/3
    assert_close(group_advantages(r, len(r)), torch.tensor([-2 / 3, 1 / 3, 1 / 3]))
    assert_close(group_advantages([1.0], 1, scale_std=True), torch.tensor([0.0]))  # group of one: no NaN
    assert group_advantages(torch.tensor([1, 0]), 2).dtype == torch.float32  # int rewards -> float
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages([1.0, 0.0, 1.0, 0.0], 3)


# ---------------------------------------------------------------------------------------------------
# build_batch
# ---------------------------------------------------------------------------------------------------
def test_build_batch_layout():
    b = build_batch([[5, 6], [7]], [[8, 9, 10], [11]], [[0, 1, 1], [0]], torch.tensor([0.5, -0.5]), pad_id=0)
    assert_close(b["input_ids"], torch.tensor([[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]))
    assert_close(b["attention_mask"], torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]))
    assert_close(b["response_mask"], torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]))
    assert_close(b["offpolicy_mask"], torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]))
    assert_close(b["advantages"], torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match=r"offpolicy_mask\[1\]"):
        build_batch([[1], [2]], [[3], [4, 5]], [[0], [0]], torch.zeros(2), pad_id=0)
    none = build_batch([[5]], [[8, 9]], [None], torch.zeros(1), pad_id=0)  # Trajectory's default mask
    assert_close(none["offpolicy_mask"], torch.tensor([[0, 0, 0]]))
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] is empty"):
        build_batch([[]], [[3]], [[0]], torch.zeros(1), pad_id=0)


# ---------------------------------------------------------------------------------------------------
# policy_loss: hand-computed numbers
# ---------------------------------------------------------------------------------------------------
def hand_inputs():
    """Two members of the group with rewards [1, 0, 0, 1]: A = +0.5 (row 0) and -0.5 (row 1).
    A 2x3 response mask [[1, 1, 1], [1, 1, 0]]; one off-policy token, (0, 2). Probabilities chosen so
    every number below is exact. Junk at the padding position (1, 2) must not matter."""
    adv = torch.tensor([0.5, -0.5])  # group_advantages of [1, 0, 0, 1], first two (by hand: mean 0.5)
    logp = torch.tensor([[LN(0.5), LN(0.6), LN(0.4)], [LN(0.3), LN(0.35), 0.0]], dtype=torch.float64)
    old = torch.tensor([[LN(0.5), LN(0.4), LN(0.9)], [LN(0.5), LN(0.4), -5.0]], dtype=torch.float64)
    resp = torch.tensor([[1, 1, 1], [1, 1, 0]])
    off = torch.tensor([[0, 0, 1], [0, 0, 0]])
    # ref_logp - logp = r: +ln2 at (0, 0), -ln2 at (1, 0), 0 elsewhere; junk 3.0 at the padding
    ref = logp.clone()
    ref[0, 0] += LN(2.0)
    ref[1, 0] -= LN(2.0)
    ref[1, 2] = 3.0
    ent = torch.tensor([[1.0, 2.0, 0.5], [1.5, 1.0, 9.9]], dtype=torch.float64)
    return logp, old, adv.double(), resp, off, ref, ent


# Per-token loss (eps = 0.2, gamma = 0.1):
#   (0,0) on,  rho = .5/.5 = 1,     A=+.5: -min(.5, .5)               = -0.5
#   (0,1) on,  rho = .6/.4 = 1.5,   A=+.5: -min(.75, 1.2*.5 = .6)      = -0.6   (clipped)
#   (0,2) off, pi = .4, f = .4/.5 = .8,  A=+.5: -.8*.5                  = -0.4
#   (1,0) on,  rho = .3/.5 = .6,    A=-.5: -min(-.3, .8*-.5 = -.4)     = +0.4   (clipped)
#   (1,1) on,  rho = .35/.4 = .875, A=-.5: -min(-.4375, -.4375)        = +0.4375
#   policy-gradient sum = -0.6625
# k3 = e^r - r - 1: (0,0) 2 - ln2 - 1 = 0.3068528, (1,0) 0.5 + ln2 - 1 = 0.1931472 -> sum 0.5, mean 0.1
# entropy over the 5 response tokens: 1 + 2 + .5 + 1.5 + 1 = 6.0, mean 1.2
# with kl_coef = 0.1, entropy_coef = 0.01: sum = -0.6625 + 0.05 - 0.06 = -0.6725
# constant: Z = N * max_new_tokens = 2 * 3 = 6; token-mean: Z = 5 response tokens
# clip_frac = 2 clipped / 4 on-policy = 0.5; ratio_mean = (1 + 1.5 + .6 + .875) / 4 = 0.99375
# shaped_mean = 0.8 (one off-policy token); offpolicy_share = 1 / 5 = 0.2
def test_clipped_surrogate_hand_computed():
    """PPO clipped surrogate alone, on the on-policy tokens of hand_inputs (numbers in the table below)."""
    logp, old, adv, resp, off, _, _ = hand_inputs()
    on = resp * (1 - off)  # [[1, 1, 0], [1, 1, 0]]
    loss, ratio, clipped = clipped_surrogate(logp, old, adv, on, clip_eps=0.2)
    assert_close(loss, torch.tensor([[-0.5, -0.6, 0.0], [0.4, 0.4375, 0.0]], dtype=torch.float64))
    assert_close(ratio, torch.tensor([[1.0, 1.5, 1.0], [0.6, 0.875, 1.0]], dtype=torch.float64))
    assert clipped.tolist() == [[False, True, False], [True, False, False]]
    # eps = 1: nothing clips; -rho*A for every token
    loss, _, clipped = clipped_surrogate(logp, old, adv, on, clip_eps=1.0)
    assert_close(loss, torch.tensor([[-0.5, -0.75, 0.0], [0.3, 0.4375, 0.0]], dtype=torch.float64))
    assert not clipped.any()


def test_shaped_offpolicy_loss_hand_computed():
    """LUFFY shaping alone: f(0.4) = 0.4/0.5 = 0.8, f(0.1) = 0.1/0.2 = 0.5 with gamma = 0.1;
    loss = -f*A, 0 off the mask; gradient -A*gamma*pi/(pi+gamma)^2 = -A*0.16 and -A*0.25."""
    logp = torch.tensor([[LN(0.4), LN(0.1), LN(0.9)], [LN(0.4), LN(0.1), -7.0]], dtype=torch.float64,
                        requires_grad=True)
    adv = torch.tensor([0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, shaped = shaped_offpolicy_loss(logp, adv, mask, shaping_gamma=0.1)
    assert_close(loss, torch.tensor([[-0.4, -0.25, 0.0], [1.6, 1.0, 0.0]], dtype=torch.float64))
    assert_close(shaped, torch.tensor([[0.8, 0.5, 0.0], [0.8, 0.5, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[-0.08, -0.125, 0.0], [0.32, 0.5, 0.0]], dtype=torch.float64))


def test_loss_normaliser_hand_computed():
    resp = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert loss_normaliser(resp, "constant", 7) == 14.0  # N * max_new_tokens = 2 * 7 (Dr. GRPO)
    assert loss_normaliser(resp, "token-mean", 7) == 5.0  # 5 response tokens
    assert loss_normaliser(torch.zeros(3, 4), "token-mean", None) == 1.0  # empty: never divide by 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        loss_normaliser(resp, "constant", 0)
    with pytest.raises(ValueError, match="loss_agg"):
        loss_normaliser(resp, "seq-mean", 7)


def test_logprobs_and_entropy_hand_computed():
    """Two positions over a vocabulary of 2: logits [0, ln 3] -> probs [.25, .75], target 1;
    logits [0, 0] -> [.5, .5], target 0. logp = [ln .75, ln .5];
    entropy = [-(.25 ln .25 + .75 ln .75), ln 2] = [0.5623351446, 0.6931471806]."""
    logits = torch.tensor([[[0.0, LN(3.0)], [0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    logp, ent = logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    assert_close(logp, torch.tensor([[LN(0.75), LN(0.5)]], dtype=torch.float64))
    assert_close(ent, torch.tensor([[0.5623351446, 0.6931471806]], dtype=torch.float64))
    assert logp.requires_grad and not ent.requires_grad  # no entropy graph unless asked for
    _, ent = logprobs_and_entropy(logits, torch.tensor([[1, 0]]), entropy_grad=True)
    assert ent.requires_grad
    assert_close(entropy_from_logprobs(torch.log(torch.tensor([0.25, 0.75]))), torch.tensor(0.5623351446))
    half, _ = logprobs_and_entropy(logits.detach().to(torch.bfloat16), torch.tensor([[1, 0]]))
    assert half.dtype == torch.float32  # bf16 logits are upcast before log_softmax


@pytest.mark.parametrize("loss_agg,z", [("constant", 6.0), ("token-mean", 5.0)])
def test_policy_loss_hand_computed(loss_agg, z):
    logp, old, adv, resp, off, ref, ent = hand_inputs()
    loss, terms = policy_loss(logp, old, adv, resp, off, loss_agg=loss_agg, max_new_tokens=3)
    assert_close(loss, torch.tensor(-0.6625 / z, dtype=torch.float64))
    m = loss_metrics(terms)
    expected = {"clip_frac": 0.5, "ratio_mean": 0.99375, "shaped_mean": 0.8,
                "offpolicy_share": 0.2, "kl": 0.0, "entropy": 0.0, "entropy_policy": 0.0}
    assert set(m) == set(expected) and all(type(v) is float for v in m.values())
    assert_close(m, expected)

    loss, terms = policy_loss(logp, old, adv, resp, off, loss_agg=loss_agg, max_new_tokens=3,
                              ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    assert_close(loss, torch.tensor(-0.6725 / z, dtype=torch.float64))
    m = loss_metrics(terms)
    # entropy over the 5 response tokens 6.0 / 5; over the 4 policy-written ones (1 + 2 + 1.5 + 1) / 4
    assert_close(m, {**expected, "kl": 0.1, "entropy": 1.2, "entropy_policy": 1.375})


def test_policy_loss_without_clipping_is_luffy_ratio():
    """clip_eps=inf is LUFFY's released setting (no clip): on-policy loss = -rho*A."""
    logp, old, adv, resp, off, _, _ = hand_inputs()
    # -.5*1 - .5*1.5 - .4 + .5*.6 + .5*.875 = -0.5 - 0.75 - 0.4 + 0.3 + 0.4375 = -0.9125
    loss, terms = policy_loss(logp, old, adv, resp, off, clip_eps=float("inf"), max_new_tokens=3)
    assert_close(loss, torch.tensor(-0.9125 / 6, dtype=torch.float64))
    assert loss_metrics(terms)["clip_frac"] == 0.0


def test_policy_loss_errors():
    logp, old, adv, resp, off, _, _ = hand_inputs()
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy_loss(logp, old, adv, resp, off)  # constant needs max_new_tokens
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(logp, old, adv, resp, off, loss_agg="seq-mean", max_new_tokens=3)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old[:, :2], adv, resp, off, max_new_tokens=3)


# ---------------------------------------------------------------------------------------------------
# policy_loss: closed-form gradients
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_agg,z", [("constant", 6.0), ("token-mean", 5.0)])
def test_policy_loss_gradient_closed_form(loss_agg, z):
    logp, old, adv, resp, off, _, _ = hand_inputs()
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, resp, off, loss_agg=loss_agg, max_new_tokens=3)
    loss.backward()
    g, pi, gamma = logp.grad, 0.4, 0.1
    expected = torch.tensor([
        # (0,0) inside the clip: -A*rho/Z; (0,1) clipped: 0; (0,2) off-policy: -A*gamma*pi/(pi+gamma)^2/Z
        [-0.5 * 1.0 / z, 0.0, -0.5 * gamma * pi / (pi + gamma) ** 2 / z],
        # (1,0) clipped: 0; (1,1) inside: -A*rho/Z with A=-0.5, rho=0.875; (1,2) padding: 0
        [0.0, 0.5 * 0.875 / z, 0.0],
    ], dtype=torch.float64)
    assert_close(g, expected)


def test_kl_and_entropy_gradients():
    """k3 gradient d/dlogp (e^r - r - 1) = 1 - e^r with r = ref - logp; the entropy bonus gives
    d loss / d H = -entropy_coef / Z. Guards the classic bug of a KL with no gradient."""
    logp, old, _, resp, off, ref, ent = hand_inputs()
    adv = torch.zeros(2, dtype=torch.float64)  # isolate the KL and entropy terms
    logp.requires_grad_(True)
    ent.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, resp, off, max_new_tokens=3, ref_logp=ref, kl_coef=0.1,
                          entropy=ent, entropy_coef=0.01)
    loss.backward()
    r = (ref - logp).detach() * resp
    assert_close(logp.grad, 0.1 * (1 - torch.exp(r)) * resp / 6)
    assert_close(ent.grad, -0.01 * resp.double() / 6)


def test_junk_outside_its_tokens_gives_no_nan():
    """Regression: old_logp is unused on off-policy tokens and on padding. If it holds inf or NaN
    there, torch.where alone would still leak 0*inf = NaN into the gradient; the log-ratio is masked
    before exp, so loss and gradient stay finite."""
    logp, old, adv, resp, off, ref, ent = hand_inputs()
    old[0, 2], old[1, 2] = -float("inf"), float("nan")
    ref[1, 2], ent[1, 2] = float("nan"), float("inf")
    logp.requires_grad_(True)
    loss, terms = policy_loss(logp, old, adv, resp, off, max_new_tokens=3, ref_logp=ref, kl_coef=0.1,
                              entropy=ent, entropy_coef=0.01)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert_close(loss, torch.tensor(-0.6725 / 6, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# policy_loss on random data, against stored values
# ---------------------------------------------------------------------------------------------------
STORED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "policy_loss_random.json")


def random_loss_inputs(seed):
    """Random (N, L) = (5, 7) inputs of policy_loss: masks, log-probs, old/ref log-probs that clip some tokens,
    entropies, advantages; and the keyword arguments of the stored case."""
    g = torch.Generator().manual_seed(seed)
    n, length = 5, 7
    resp = (torch.rand(n, length, generator=g) < 0.7).long()
    off = (torch.rand(n, length, generator=g) < 0.4).long() * resp
    logp = torch.log(torch.rand(n, length, generator=g, dtype=torch.float64) * 0.95 + 0.05)
    old = logp + 0.4 * torch.randn(n, length, generator=g, dtype=torch.float64)  # some tokens clip
    ref = logp + 0.3 * torch.randn(n, length, generator=g, dtype=torch.float64)
    ent = 3 * torch.rand(n, length, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    kw = dict(clip_eps=0.2, shaping_gamma=0.1, max_new_tokens=9, kl_coef=0.05, entropy_coef=0.01)
    return dict(logp=logp, old_logp=old, advantages=adv, response_mask=resp, offpolicy_mask=off, ref_logp=ref,
                entropy=ent), kw


@pytest.mark.parametrize("loss_agg", ["constant", "token-mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_matches_loop(loss_agg, seed):
    """Loss, gradient w.r.t. logp and metrics on random data equal the values a per-token loop written
    straight from the module docstring gives (stored in tests/fixtures/policy_loss_random.json)."""
    with open(STORED, encoding="utf-8") as f:
        want = json.load(f)[f"{loss_agg}-{seed}"]
    x, kw = random_loss_inputs(seed)
    logp = x.pop("logp").clone().requires_grad_(True)
    loss, terms = policy_loss(logp, loss_agg=loss_agg, **x, **kw)
    loss.backward()
    assert_close(float(loss.detach()), want["loss"], rtol=1e-9, atol=1e-12)
    assert_close(logp.grad, torch.tensor(want["grad"], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    m = loss_metrics(terms)
    m.pop("entropy_policy")
    assert_close(m, want["metrics"], rtol=1e-9, atol=1e-12)
    assert 0 < m["clip_frac"] < 1 and abs(want["loss"]) > 1e-3  # both branches run; the value is not ~0


# ---------------------------------------------------------------------------------------------------
# token_logprobs on a tiny Qwen2
# ---------------------------------------------------------------------------------------------------
def tiny_batch(tok, n=4, seed=0, max_prompt=5, max_resp=6):
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)

    def ids(k):
        return torch.randint(4, vocab, (k,), generator=g).tolist()

    prompts = [ids(int(torch.randint(1, max_prompt + 1, (1,), generator=g))) for _ in range(n)]
    responses = [ids(int(torch.randint(1, max_resp + 1, (1,), generator=g))) for _ in range(n)]
    # off-policy suffix after a random kept prefix, like a rectified trajectory
    offmask = []
    for r in responses:
        cut = int(torch.randint(0, len(r) + 1, (1,), generator=g))
        offmask.append([0] * cut + [1] * (len(r) - cut))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * (n // 4) + [1.0] * (n % 4))
    adv = rewards - rewards.mean()  # an input here (one group), not the quantity under test
    return build_batch(prompts, responses, offmask, adv, pad_id=tok.pad_token_id), prompts, responses


def test_token_logprobs_matches_plain_forward(bpe_tokenizer):
    tok = bpe_tokenizer
    model = make_tiny_causal_lm(tok)
    batch, prompts, responses = tiny_batch(tok, n=5)
    logp, ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 2)
    assert logp.shape == ent.shape == batch["input_ids"].shape and not logp.requires_grad
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (T, V) one unpadded row, plain forward
        # written another way than grpo.py: log p(v) = z_v - logsumexp(z); H = logsumexp(z) - E_p[z]
        z = logits.double()[:-1]  # (T-1, V) the distributions that produced tokens 1..T-1
        lse = torch.logsumexp(z, dim=-1)  # (T-1,)
        want = (z[torch.arange(len(z)), ids[0, 1:]] - lse).float()  # logp of token t given tokens < t
        want_ent = (lse - (torch.softmax(z, dim=-1) * z).sum(-1)).float()
        a, b = len(p), len(p) + len(r)
        assert_close(logp[i, a:b], want[a - 1:b - 1], atol=1e-5, rtol=1e-5)
        assert_close(ent[i, a:b], want_ent[a - 1:b - 1], atol=1e-5, rtol=1e-5)
        assert (logp[i, :a] == 0).all() and (logp[i, b:] == 0).all()
        assert (ent[i, :a] == 0).all() and (ent[i, b:] == 0).all()
    logp1, ent1 = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 5)
    assert_close(logp1, logp, atol=1e-5, rtol=1e-5)
    assert_close(ent1, ent, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# update
# ---------------------------------------------------------------------------------------------------
def prepared(model, tok, n=4, seed=0, noise=0.3):
    batch, _, _ = tiny_batch(tok, n=n, seed=seed)
    logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], n)
    g = torch.Generator().manual_seed(seed + 100)
    # pretend the sampling policy differed a little, so ratios move and some tokens clip
    batch["old_logp"] = logp + noise * torch.randn(logp.shape, generator=g, dtype=logp.dtype) * batch["response_mask"]
    return batch


def param_vector(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_update_micro_batches_equal_full_batch(opt, max_grad_norm):
    """Micro-batch 1, 2 and the full batch give the same parameters after one step (float64, both
    aggregations, KL and entropy on, with and without an active grad clip; tolerance rtol 1e-9,
    atol 1e-12 — measured differences are ~1e-17 for SGD and ~1e-14 for AdamW against parameter
    changes of ~1e-2). Guards normalising by each micro-batch instead of the whole batch."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    ref_model = make_tiny_causal_lm(tok, seed=1).double()
    for loss_agg in ("constant", "token-mean"):
        batch = prepared(model, tok, n=4)
        results = {}
        for mb in (1, 2, 4):
            m = copy.deepcopy(model)
            if opt == "sgd":
                optim = torch.optim.SGD(m.parameters(), lr=1.0)  # large lr: differences would show
            else:
                optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
            metrics = update(m, optim, batch, micro_batch_size=mb, max_grad_norm=max_grad_norm,
                             loss_agg=loss_agg, max_new_tokens=6, kl_coef=0.05, entropy_coef=0.01,
                             ref_model=ref_model)
            results[mb] = (param_vector(m), metrics)
        p4, m4 = results[4]
        assert not torch.equal(p4, param_vector(model)) and m4["skipped"] == 0.0
        if max_grad_norm is not None:
            assert m4["grad_norm"] > max_grad_norm  # the clip is active, and is part of what must agree
        for mb in (1, 2):
            p, metrics = results[mb]
            assert_close(p, p4, rtol=1e-9, atol=1e-12)
            same = [k for k in m4 if k != "pad_share"]   # the padding computed depends on the micro-batch size
            assert_close({k: metrics[k] for k in same}, {k: m4[k] for k in same}, rtol=1e-9, atol=1e-12)


def test_update_loss_equals_policy_loss():
    """The loss `update` reports is policy_loss on a plain forward of the whole batch."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch = prepared(model, tok, n=4)
    logp, ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 4)
    loss, terms = policy_loss(logp, batch["old_logp"], batch["advantages"], batch["response_mask"],
                              batch["offpolicy_mask"], max_new_tokens=6, entropy=ent, entropy_coef=0.01)
    want = {"loss": float(loss.detach()), **loss_metrics(terms)}
    got = update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, micro_batch_size=3,
                 max_new_tokens=6, entropy_coef=0.01)
    assert_close({k: got[k] for k in want}, want, rtol=1e-9, atol=1e-12)


def test_the_warm_up_sets_each_steps_learning_rate_in_update():
    """warmup_lr by hand (lr 1e-3 over 4 steps: 2.5e-4 at step 1, 1e-3 from step 4 on; 0 steps: lr throughout), and
    update trains at the lr it is given: a resumed optimizer keeps its checkpoint's lr, so the step's own must win
    (None: the optimizer's lr stays)."""
    assert [warmup_lr(1e-3, s, 4) for s in (1, 2, 4, 9)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3], abs=0)
    assert warmup_lr(1e-3, 1, 0) == 1e-3
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch = prepared(model, tok, n=4)
    moved = []
    for lr in (None, 0.5):
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        update(net, opt, batch, micro_batch_size=4, max_new_tokens=6, lr=lr)
        assert opt.param_groups[0]["lr"] == (0.0 if lr is None else 0.5)
        moved.append(max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), model.parameters())))
    assert moved[0] == 0.0 and moved[1] > 1e-6   # lr 0 kept: nothing moves; lr 0.5 given: the weights move


def test_update_computes_its_loss_with_policy_loss(monkeypatch):
    """update has no loss of its own: it calls the public policy_loss once per micro-batch with the WHOLE
    batch's Z, and reports the sum of what policy_loss returned (a private copy of the loss would fail this)."""
    import grpo
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch = prepared(model, tok, n=5)
    calls, real = [], grpo.policy_loss

    def spy(*a, **k):
        loss, terms = real(*a, **k)
        calls.append((a[0].shape[0], k["z"], float(loss.detach())))
        return loss, terms

    monkeypatch.setattr(grpo, "policy_loss", spy)
    got = update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, micro_batch_size=2, max_new_tokens=6)
    assert [c[0] for c in calls] == [2, 2, 1]
    assert {c[1] for c in calls} == {loss_normaliser(batch["response_mask"], "constant", 6)} == {30.0}
    assert_close(got["loss"], sum(c[2] for c in calls))


def test_update_changes_every_parameter_tiny_qwen2(bpe_tokenizer):
    tok = bpe_tokenizer
    model = make_tiny_causal_lm(tok)
    batch = prepared(model, tok, n=4)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    metrics = update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch, micro_batch_size=2,
                     max_new_tokens=6)
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"
    assert set(metrics) == {"loss", "grad_norm", "skipped", "pad_share", "clip_frac", "ratio_mean", "shaped_mean",
                            "offpolicy_share", "kl", "entropy", "entropy_policy"}
    assert all(type(v) is float for v in metrics.values())


def test_update_kl_from_ref_model():
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok)
    batch = prepared(model, tok, n=4)
    same = update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                  micro_batch_size=2, max_new_tokens=6, kl_coef=0.1, ref_model=copy.deepcopy(model))
    assert abs(same["kl"]) < 1e-6  # reference == policy: k3 = 0
    other = update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                   micro_batch_size=2, max_new_tokens=6, kl_coef=0.1, ref_model=make_tiny_causal_lm(tok, seed=3))
    assert other["kl"] > 1e-4
    with pytest.raises(ValueError, match=r"needs batch\['ref_logp'\] or ref_model"):
        update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, micro_batch_size=2,
               max_new_tokens=6, kl_coef=0.1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, dict(rtol=1e-9, atol=1e-12)),
                                       (torch.float32, dict(rtol=1e-4, atol=1e-6))])
def test_update_without_old_logp_gives_the_separate_pass_gradient(dtype, tol):
    """With one optimizer step per rollout batch, `update` without old_logp uses its own
    log-probs, detached, as old log-probs (rho = 1 exactly). The parameter change after one SGD step
    (lr = 1, so it is minus the gradient) must equal the change with old_logp from a separate no-grad
    forward (`token_logprobs`); both aggregations, KL and entropy on, two micro-batch sizes.
    The logged entropy over policy-written tokens must equal that pass's masked mean."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).to(dtype)
    ref_model = make_tiny_causal_lm(tok, seed=1).to(dtype)
    batch, _, _ = tiny_batch(tok, n=5, seed=3)
    start = param_vector(model)
    logp, ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 5)
    on = batch["response_mask"] * (1 - batch["offpolicy_mask"])
    want_entropy = float((ent * on).sum() / on.sum())
    for loss_agg in ("constant", "token-mean"):
        for mb in (2, 5):
            kw = dict(micro_batch_size=mb, max_grad_norm=None, loss_agg=loss_agg, max_new_tokens=6,
                      kl_coef=0.05, entropy_coef=0.01, ref_model=ref_model)
            a, b = copy.deepcopy(model), copy.deepcopy(model)
            ma = update(a, torch.optim.SGD(a.parameters(), lr=1.0), {**batch, "old_logp": logp}, **kw)
            mb_ = update(b, torch.optim.SGD(b.parameters(), lr=1.0), batch, **kw)
            da, db = param_vector(a) - start, param_vector(b) - start
            assert da.abs().max() > 1e-4  # the step did move the parameters
            assert_close(db, da, **tol)
            assert mb_["ratio_mean"] == 1.0 and mb_["clip_frac"] == 0.0  # rho = 1 exactly
            assert_close(mb_["loss"], ma["loss"], **tol)
            assert_close(mb_["entropy_policy"], want_entropy, **tol)
            assert_close(ma["entropy_policy"], want_entropy, **tol)


@pytest.mark.parametrize("how", ["nan_advantage", "inf_gradient"])
def test_update_non_finite_guard(how):
    """A NaN loss, or a finite loss with an infinite gradient, must not touch the parameters (bit for
    bit) nor the optimizer state; the step is reported as skipped, and the next good step works."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok)
    batch = prepared(model, tok, n=4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    bad = dict(batch)
    hook = None
    if how == "nan_advantage":
        bad["advantages"] = batch["advantages"].clone()
        bad["advantages"][1] = float("nan")
    else:
        hook = model.model.norm.weight.register_hook(lambda g: g * float("inf"))
    metrics = update(model, optim, bad, micro_batch_size=2, max_new_tokens=6)
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and len(optim.state) == 0
    if hook is not None:
        assert math.isfinite(metrics["loss"]) and not math.isfinite(metrics["grad_norm"])
        hook.remove()
    good = update(model, optim, batch, micro_batch_size=2, max_new_tokens=6)
    assert good["skipped"] == 0.0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------------------------------------------
# truncated importance sampling against the sampler (vLLM)
# ---------------------------------------------------------------------------------------------------
def test_truncated_is_weight_by_hand():
    """w = min(π_old / π_sampler, C) on the policy tokens with a known sampler log-prob, 1 elsewhere, detached;
    None when TIS is off (cap 0) or the batch has no sampler log-probs."""
    old = torch.tensor([[0.0, LN(0.5), LN(0.2), LN(0.9), LN(0.7), LN(0.6)]], requires_grad=True)
    sampler = torch.tensor([[9.0, LN(0.25), LN(0.4), LN(0.3), LN(0.1), LN(0.1)]])
    batch = {"sampler_logp": sampler, "sampler_mask": torch.tensor([[0, 1, 1, 1, 0, 1]]),
             "response_mask": torch.tensor([[0, 1, 1, 1, 1, 1]]), "offpolicy_mask": torch.tensor([[0, 0, 0, 0, 0, 1]])}
    w = truncated_is_weight(old, batch, cap=2.5)
    # prompt -> 1; 0.5/0.25 = 2 (under the cap), 0.2/0.4 = 0.5, 0.9/0.3 = 3 -> 2.5 (capped); unknown sampler
    # log-prob -> 1 (7 otherwise); refiner token -> 1 (6 otherwise)
    assert_close(w, torch.tensor([[1.0, 2.0, 0.5, 2.5, 1.0, 1.0]]))
    assert not w.requires_grad
    sampler[0, 4] = float("inf")  # junk where no sampler log-prob is known never reaches the weight
    assert_close(truncated_is_weight(old, batch, cap=2.5), w)
    assert truncated_is_weight(old, batch, cap=0.0) is None
    assert truncated_is_weight(old, {k: v for k, v in batch.items() if k != "sampler_logp"}, cap=2.0) is None
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weight(old, batch, cap=0.5)


def test_policy_loss_with_is_weight_by_hand():
    """The weight multiplies the policy tokens' surrogate only; the refiner token keeps LUFFY's f(π) = 0.8.
    One sequence, response at positions 1..3, A = 1, ρ = 1, token 3 written by the refiner, token-mean Z = 3."""
    logp = torch.tensor([[0.0, LN(0.5), LN(0.2), LN(0.4)]], requires_grad=True)
    resp, off, adv = torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 0, 0, 1]]), torch.tensor([1.0])
    weight = torch.tensor([[7.0, 2.0, 0.5, 5.0]])  # 7 (prompt) and 5 (refiner token) must be ignored
    kw = dict(loss_agg="token-mean", shaping_gamma=0.1)
    plain, _ = policy_loss(logp, logp.detach(), adv, resp, off, **kw)
    loss, terms = policy_loss(logp, logp.detach(), adv, resp, off, is_weight=weight, **kw)
    assert_close(float(plain.detach()), (-1 - 1 - 0.8) / 3)     # -0.9333
    assert_close(float(loss.detach()), (-2 - 0.5 - 0.8) / 3)    # -1.1
    loss.backward()
    # d/dlogp: -A·ρ·w/Z on policy tokens; -A·γπ/(π+γ)²/Z = -0.04/0.25/3 on the refiner's token
    assert_close(logp.grad, torch.tensor([[0.0, -2 / 3, -0.5 / 3, -0.16 / 3]]))
    assert_close(terms["is_weight"], weight)


def test_build_batch_lays_out_sampler_logprobs():
    """A row's sampler log-probs cover its FIRST len() response tokens (a repaired trajectory keeps its
    prefix's); None = none known."""
    b = build_batch([[5, 6], [7]], [[1, 2, 3], [4, 4]], [[0, 0, 1], None], torch.zeros(2), pad_id=0)
    rows = sampler_rows([[5, 6], [7]], [[1, 2, 3], [4, 4]], [[-0.1, -0.2], None], b["input_ids"].shape[1])
    assert rows["sampler_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert_close(rows["sampler_logp"][0, 2:4], torch.tensor([-0.1, -0.2]))
    assert (rows["sampler_logp"][b["response_mask"] == 0] == 0).all()   # prompt and padding: none known
    assert "sampler_logp" not in b
    with pytest.raises(ValueError, match="sampler_logp\\[0\\] has 3 entries for 2"):
        sampler_rows([[5]], [[1, 2]], [[0.0, 0.0, 0.0]], 3)
    with pytest.raises(ValueError, match="1 sampler_logp rows for 2 sequences"):
        sampler_rows([[5], [6]], [[1], [2]], [[0.0]], 2)


@pytest.mark.parametrize("gap, cap, weight", [(1.5, 2.0, 1.5), (3.0, 2.0, 2.0), (3.0, 0.0, 1.0)])
def test_update_weights_policy_tokens_by_the_truncated_ratio(gap, cap, weight):
    """Sampler log-probs lower than the trainer's by ln(gap): every policy token's weight is min(gap, cap), so
    update's loss (ρ = 1: Σ -A·w / Z) is `weight` times the unweighted one; tis_cap 0 turns it off."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch, prompts, responses = tiny_batch(tok, n=4)
    batch = build_batch(prompts, responses, [None] * 4, torch.tensor([1.0, 0.5, -0.25, 1.0]), tok.pad_token_id)
    logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 4)
    sampler = [(logp[i, len(p):len(p) + len(r)] - LN(gap)).tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
    with_logp = {**batch, **sampler_rows(prompts, responses, sampler, batch["input_ids"].shape[1])}
    kw = dict(micro_batch_size=3, loss_agg="token-mean")
    plain = update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch, **kw)
    got = update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), with_logp, tis_cap=cap, **kw)
    assert abs(plain["loss"]) > 0.1
    # sampler log-probs are stored in float32: agreement to float32 precision
    assert_close(got["loss"], weight * plain["loss"], rtol=1e-6, atol=1e-9)
    if cap:
        assert_close(got["tis_weight_mean"], weight, rtol=1e-6, atol=1e-9)
        assert got["tis_capped_frac"] == (1.0 if gap > cap else 0.0)
    else:
        assert "tis_weight_mean" not in got
# memory savers: chunked log-probs, length-sorted micro-batches, gradient checkpointing, fused AdamW
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_equal_the_whole_log_softmax(entropy_grad):
    """Chunks of 3 tokens (2 rows: 1 position per chunk, a last chunk shorter) give the values and the
    gradient of one log-softmax over all positions, float64."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)  # (n, T, V)
    targets = torch.randint(0, 11, (2, 7), generator=g)  # (n, T)
    weights = torch.randn(2, 7, generator=g, dtype=torch.float64)  # (n, T) any downstream use
    grads = []
    for chunk in (3, 0):   # 0: one chunk, no recomputation
        taken, ent = chunked_logprobs_and_entropy(logits, targets, logprobs_and_entropy, entropy_grad, chunk_tokens=chunk)
        assert ent.requires_grad == entropy_grad
        out = (taken * weights).sum() + ((ent * weights).sum() if entropy_grad else 0.0)
        grads.append((taken.detach(), ent.detach(), torch.autograd.grad(out, logits)[0]))
    whole = torch.log_softmax(logits.detach(), -1)  # (n, T, V)
    assert_close(grads[0][0], whole.gather(-1, targets.unsqueeze(-1)).squeeze(-1), rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[0], grads[1]):
        assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert grads[0][2].abs().sum() > 0.1


def test_logprobs_at_the_rollout_temperature_by_hand():
    """softmax(z / T) by hand: z = (0, ln 3) at T = 0.5 is softmax(0, ln 9) = (0.1, 0.9); chunked or whole, the
    log-prob of token 1 is ln 0.9 and the entropy −(0.1 ln 0.1 + 0.9 ln 0.9), with the gradient of that tempered
    log-softmax (d ln p_1 / d z = (e_1 − p) / T)."""
    z = torch.tensor([[[0.0, LN(3)]] * 3], dtype=torch.float64, requires_grad=True)  # (1, 3, 2)
    targets = torch.ones(1, 3, dtype=torch.long)
    for chunk in (1, 0):
        taken, ent = chunked_logprobs_and_entropy(z, targets, logprobs_and_entropy, chunk_tokens=chunk, temperature=0.5)
        assert_close(taken, torch.full((1, 3), LN(0.9), dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert_close(ent, torch.full((1, 3), -(0.1 * LN(0.1) + 0.9 * LN(0.9)), dtype=torch.float64))
        grad, = torch.autograd.grad(taken.sum(), z)
        assert_close(grad, torch.tensor([[[-0.1 / 0.5, 0.1 / 0.5]] * 3], dtype=torch.float64))
    plain, _ = chunked_logprobs_and_entropy(z, targets, logprobs_and_entropy, chunk_tokens=0)   # T = 1: (0.25, 0.75)
    assert_close(plain.detach(), torch.full((1, 3), LN(0.75), dtype=torch.float64))


def test_update_at_the_rollout_temperature_matches_a_tempered_sampler():
    """Rollouts drawn at T = 0.7 carry the sampler's log-probs of softmax(logits / 0.7) (what vLLM returns as
    processed log-probs): the update at temperature 0.7 sees the sampler and the trainer agree (weight 1, the loss
    of no correction), the update at T = 1 would weight every token by a wrong ratio; with two steps per batch the
    π_old pass is tempered too (ρ = 1 at lr 0, so its loss is the mean of the two halves' one-step losses)."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch, prompts, responses = tiny_batch(tok, n=4)
    batch = build_batch(prompts, responses, [None] * 4, torch.tensor([1.0, 0.5, -0.25, 1.0]), tok.pad_token_id)
    cold, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 4,
                             temperature=0.7)
    warm, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 4)
    assert (cold - warm).abs().max() > 0.05   # the temperature changes the log-probs
    sampler = [cold[i, len(p):len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses))]
    with_logp = {**batch, **sampler_rows(prompts, responses, sampler, batch["input_ids"].shape[1])}
    kw = dict(micro_batch_size=3, loss_agg="token-mean")
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.0)
    plain = update(copy.deepcopy(model), sgd(model), batch, temperature=0.7, **kw)
    tempered = update(copy.deepcopy(model), sgd(model), with_logp, tis_cap=2.0, temperature=0.7, **kw)
    assert_close(tempered["tis_weight_mean"], 1.0, rtol=1e-6, atol=1e-6)
    assert_close(tempered["loss"], plain["loss"], rtol=1e-6, atol=1e-9)
    untempered = update(copy.deepcopy(model), sgd(model), with_logp, tis_cap=2.0, **kw)   # scored at T = 1
    plain_1 = update(copy.deepcopy(model), sgd(model), batch, **kw)
    assert abs(untempered["loss"] - plain_1["loss"]) > 1e-3 * abs(plain_1["loss"])   # weights w = π_1/π_0.7 ≠ 1
    m = copy.deepcopy(model)
    epoch = update(m, sgd(m), batch, [0, 0, 1, 1], updates_per_batch=2, temperature=0.7, **kw)
    halves = [update(copy.deepcopy(model), sgd(model), {k: v[rows] for k, v in batch.items()}, temperature=0.7, **kw)
              for rows in ([0, 1], [2, 3])]
    assert_close(epoch["loss"], sum(h["loss"] for h in halves) / 2, rtol=1e-6, atol=1e-9)


def test_length_sorted_micro_batches_hand_computed():
    lengths = [3, 7, 5, 7, 2]
    groups = length_sorted_micro_batches(lengths, 2)
    assert groups == [[1, 3], [2, 0], [4]]   # longest first; ties keep their order
    # computed positions 2·7 + 2·5 + 1·2 = 26, real ones 24: padding 2/26
    assert padding_share(lengths, groups) == pytest.approx(2 / 26, abs=1e-12)
    assert padding_share(lengths, [[0, 1, 2, 3, 4]]) == pytest.approx(1 - 24 / 35, abs=1e-12)
    assert length_sorted_micro_batches(lengths, 9) == [[1, 3, 2, 0, 4]]


def full_batch_gradient(model, batch, entropy_coef):
    """The gradient of policy_loss from one plain forward pass over the whole batch: no trimming, no
    chunks, no sorting, no checkpointing — the reference the memory savers must reproduce."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    lp_all = torch.log_softmax(logits[:, :-1], -1)  # (N, L-1, V)
    resp = batch["response_mask"].to(lp_all.dtype)
    taken = lp_all.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, L-1)
    logp = torch.nn.functional.pad(taken, (1, 0)) * resp  # (N, L)
    ent = torch.nn.functional.pad(-(lp_all.exp() * lp_all).sum(-1), (1, 0)) * resp  # (N, L)
    loss, _ = policy_loss(logp, batch["old_logp"], batch["advantages"], batch["response_mask"],
                          batch["offpolicy_mask"], max_new_tokens=6, entropy=ent, entropy_coef=entropy_coef)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_update_gradient_with_memory_savers_equals_one_plain_pass(checkpointing, entropy_coef):
    """float64: update with gradient checkpointing (non-reentrant), log-probs in chunks of 4 tokens and
    length-sorted micro-batches of 2 over 5 rows (2 + 2 + 1: they do not divide the batch) moves the
    parameters by exactly the gradient of one plain full-batch pass (SGD, lr 1, no clip)."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch = prepared(model, tok, n=5)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1   # rows of different lengths: sorting matters
    want = full_batch_gradient(model, batch, entropy_coef)
    m = copy.deepcopy(model).train()
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert m.is_gradient_checkpointing
    before = param_vector(m)
    metrics = update(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, micro_batch_size=2, max_grad_norm=None,
                     max_new_tokens=6, entropy_coef=entropy_coef, chunk_tokens=4)
    assert 0 < metrics["pad_share"] < 1
    assert want.abs().max() > 1e-3
    assert_close(before - param_vector(m), want, rtol=1e-9, atol=1e-12)


def test_fused_adamw_equals_unfused():
    """Two update steps with torch's fused AdamW and with its default (foreach) one give the same parameters
    (float64 on the CPU, where torch >= 2.4 has the fused kernel too; the real path uses it on CUDA)."""
    tok = make_char_tokenizer()
    model = make_tiny_causal_lm(tok).double()
    batch = prepared(model, tok, n=4)
    out = {}
    for fused in (False, True):
        m = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
        for _ in range(2):
            update(m, opt, batch, micro_batch_size=2, max_new_tokens=6)
        out[fused] = param_vector(m)
    assert (out[False] - param_vector(model)).abs().max() > 1e-3
    assert_close(out[True], out[False], rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# Several optimizer steps per rollout batch: a real ratio, a clip that binds
# ---------------------------------------------------------------------------------------------------
class BiasLM(torch.nn.Module):
    """A two-token 'language model' whose logits are the same parameter w at every position:
    π(token 1) = σ(w1 − w0), whatever the context."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return type("Out", (), {"logits": self.w.expand(*input_ids.shape, 2)})()


def one_token_rows(n):
    """n groups of one row each: prompt [0], response [1] (policy-written), A = +1."""
    return build_batch([[0]] * n, [[1]] * n, [None] * n, torch.ones(n), pad_id=0)


def test_the_clip_binds_on_the_second_mini_batch_by_hand():
    """Two groups of one row each, --updates-per-batch 2, SGD lr 1, ε = 0.2, Z = 1 per mini-batch (constant,
    N = 1, max_new_tokens = 1). The no-grad pass gives π_old(1) = 0.5 for both rows (w = 0).
    Step 1 (row 0): ρ = 1, L = −ρA, ∂L/∂w = −A (onehot(1) − π) = (0.5, −0.5) → w = (−0.5, 0.5),
    π(1) = σ(1) = 0.731059. Step 2 (row 1): ρ = 0.731059 / 0.5 = 1.462117 > 1 + ε with A > 0: the clipped
    branch, L = −1.2, no gradient, w stays at (−0.5, 0.5). Means over the two steps: clip_frac (0 + 1) / 2,
    ratio_mean (1 + 1.462117) / 2, loss (−1 − 1.2) / 2."""

    model = BiasLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = update(model, opt, one_token_rows(2), [0, 1], updates_per_batch=2, micro_batch_size=4,
                   chunk_tokens=0, clip_eps=0.2, max_new_tokens=1)
    assert_close(model.w.detach(), torch.tensor([-0.5, 0.5], dtype=torch.float64))
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((1 + 1.4621171572600098) / 2)
    assert stats["loss"] == pytest.approx(-1.1)
    assert stats["skipped"] == 0.0

    # the same two steps with ρ ≡ 1 (each step its own π_old, as one step per batch would have it): no clip,
    # and step 2 moves w again by (onehot(1) − (σ(−1), σ(1))) = (−0.268941, 0.268941)
    model = BiasLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for row in range(2):
        stats = update(model, opt, {k: v[row:row + 1] for k, v in one_token_rows(2).items()}, micro_batch_size=4,
                       chunk_tokens=0, clip_eps=0.2, max_new_tokens=1)
        assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    assert_close(model.w.detach(), torch.tensor([-0.768941421, 0.768941421], dtype=torch.float64))


def test_one_update_per_batch_is_update_on_the_whole_batch():
    """--updates-per-batch 1 with the groups given is exactly one step on the whole batch, as without groups (no
    π_old pass, ρ = 1)."""

    a, b = BiasLM(), BiasLM()
    sa, sb = (update(a, torch.optim.SGD(a.parameters(), lr=1.0), one_token_rows(3), [0, 1, 2],
                     micro_batch_size=2, chunk_tokens=0, max_new_tokens=1),
              update(b, torch.optim.SGD(b.parameters(), lr=1.0), one_token_rows(3), micro_batch_size=2,
                     chunk_tokens=0, max_new_tokens=1))
    assert_close(a.w.detach(), b.w.detach())
    assert sa == sb


class RecordingDist:
    """One rank that records where DDP's `no_sync` is entered: the forwards and backwards that run inside it."""

    world = 1

    def __init__(self, model):
        self.inside, self.events = False, []
        model.register_forward_hook(lambda *a: self.events.append(("forward", self.inside)))
        for p in model.parameters():
            p.register_hook(lambda g: self.events.append(("backward", self.inside)) or g)

    sum = max = mean = staticmethod(lambda x: x)

    def all_gather(self, x):
        return [x]

    @contextlib.contextmanager
    def no_sync(self, model):
        self.inside = True
        yield
        self.inside = False


def test_ddp_exchanges_gradients_on_the_last_micro_batch_of_each_step_only():
    """Three micro-batches of one row in each of two optimizer steps: the first two of each run their forward and
    backward inside no_sync (no gradient exchange), the last outside it, so DDP all-reduces once per step."""
    model = BiasLM()
    dist = RecordingDist(model)
    update(model, torch.optim.SGD(model.parameters(), lr=0.1), one_token_rows(6), [0, 0, 0, 1, 1, 1],
           updates_per_batch=2, micro_batch_size=1, chunk_tokens=0, max_new_tokens=1, dist=dist)
    passes = [e for e in dist.events if e[0] == "backward"]
    forwards = [e for e in dist.events if e[0] == "forward"]
    assert forwards[:3] == [("forward", False)] * 3   # π_old's no-grad pass (step 2's rows): nothing to exchange
    one_step = [("forward", True), ("backward", True)] * 2 + [("forward", False), ("backward", False)]
    assert dist.events[3:] == one_step * 2
    assert len(passes) == 6


def test_update_refuses_several_steps_without_groups_before_any_forward():
    """k > 1 mini-batches need each row's group, and k < 1 is no update: one-line errors naming the argument,
    raised before the π_old pass or any optimizer step (the parameters stay as they were)."""
    model = BiasLM()
    before = model.w.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="updates_per_batch=2 needs `groups`"):
        update(model, opt, one_token_rows(2), updates_per_batch=2, micro_batch_size=4, chunk_tokens=0, max_new_tokens=1)
    with pytest.raises(ValueError, match="updates_per_batch must be at least 1, got 0"):
        update(model, opt, one_token_rows(2), [0, 1], updates_per_batch=0, micro_batch_size=4, chunk_tokens=0,
               max_new_tokens=1)
    assert_close(model.w.detach(), before)


def test_group_mini_batches_keep_groups_whole():
    """5 groups (ragged: group 3 has 3 rows) in 2 mini-batches: groups {0, 1, 2} then {3, 4}; every row once."""
    from harness.engines.trainer import group_mini_batches

    groups = [0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4]
    batch = build_batch([[0]] * 11, [[1]] * 11, [None] * 11, torch.arange(11.0), pad_id=0)
    first, second = group_mini_batches(batch, groups, 2)
    assert first["advantages"].tolist() == [0, 1, 2, 3, 4, 5] and second["advantages"].tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="1..5"):
        group_mini_batches(batch, groups, 6)
