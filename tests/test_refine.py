"""Tests for refine.py: Trajectory, Refiner prompts, splice, rectify (CPU, tiny random models)."""
import copy

import pytest
from conftest import make_char_tokenizer

from harness.data.prompt import DEFAULT_SYSTEM, format_prompt
from harness.engines.generate import Completion, HFGenerator
from harness.engines.refiner import Refiner
from refine import HINT, Suffix, Trajectory, rectify, refiner_prompt, splice

TRACE_KEYS = {"group", "question", "answer", "mode", "steps", "scores", "cut", "keep_ratio", "keep_ratio_tokens",
              "prefix_text", "suffixes", "suffix_finished", "attempt_correct", "accepted", "reward_before", "reward_after"}


def boxed_grade(text, gold):
    """A stand-in for harness.data.grader.grade: correct iff the text contains \\boxed{gold}."""
    return f"\\boxed{{{gold}}}" in text


@pytest.fixture(params=["bpe", "char"])
def policy_tok(request, bpe_tokenizer, char_tokenizer):
    return bpe_tokenizer if request.param == "bpe" else char_tokenizer


def sample_trajectories(tok, model, questions, answers, g=3, max_tokens=24, seed=0):
    """Real policy samples from a tiny HF model, grouped like scope.py does (prompt-major)."""
    prompts = [format_prompt(tok, q) for q in questions]
    out = HFGenerator(model, tok, micro_batch_size=8).generate(prompts, n=g, temperature=1.0,
                                                               max_tokens=max_tokens, seed=seed)
    return [Trajectory(question=q, answer=a, group=b, prompt_ids=p, response_ids=c.ids, text=c.text,
                       steps=[c.text], step_scores=[0.2], cut=0, keep_ratio=0.0, keep_ratio_tokens=0.5)
            for b, (q, a, p, row) in enumerate(zip(questions, answers, prompts, out)) for c in row]


# ---------- Trajectory ----------

def test_trajectory_default_mask_and_length_check():
    t = Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=[4, 5, 6], text="abc")
    assert t.offpolicy_mask == [0, 0, 0] and t.source == "policy" and t.reward == 0.0 and not t.correct
    with pytest.raises(ValueError, match="offpolicy_mask has 2 entries but response_ids has 3"):
        Trajectory(question="q", answer="1", group=2, prompt_ids=[1], response_ids=[4, 5, 6], text="abc",
                   offpolicy_mask=[0, 1])


# ---------- splice ----------

def test_splice_keeps_the_sampled_prefix_ids(policy_tok, tiny_causal_lm):
    """The prefix is a cut of a real HF sample at a token boundary; its ids must survive unchanged."""
    [t] = sample_trajectories(policy_tok, tiny_causal_lm(policy_tok), ["Let x = 3."], ["7"], g=1, max_tokens=20)
    k = len(t.response_ids) // 2
    suffix = "Next, 48 - 5 = 43.\n\nThe answer is \\boxed{43}."
    eos = policy_tok.eos_token_id
    ids, mask = splice(t.response_ids[:k], suffix, policy_tok, max_new_tokens=200, eos_id=eos)
    suffix_ids = policy_tok.encode(suffix, add_special_tokens=False)
    assert ids[:k] == t.response_ids[:k]
    assert ids == t.response_ids[:k] + suffix_ids + [eos]
    assert mask == [0] * k + [1] * (len(suffix_ids) + 1) and len(mask) == len(ids)


def test_splice_never_retokenises_the_prefix(bpe_tokenizer):
    """Guards the bug of splicing text instead of ids: 'L','e','t' sampled one by one decode to 'Let',
    which the BPE would re-encode as one token, shifting every on-policy log-prob after it."""
    singles = [bpe_tokenizer.convert_tokens_to_ids(ch) for ch in "Let"]
    assert bpe_tokenizer.encode("Let", add_special_tokens=False) != singles  # re-tokenising would differ
    ids, mask = splice(singles, " x = 3", bpe_tokenizer, max_new_tokens=50, eos_id=bpe_tokenizer.eos_token_id)
    assert ids[:3] == singles and mask[:3] == [0, 0, 0]


def test_splice_eos_and_truncation(bpe_tokenizer):
    eos = bpe_tokenizer.eos_token_id
    prefix = bpe_tokenizer.encode("First, compute 12 * 4 = 48.\n\n")
    suffix = "Next, 48 - 5 = 43."
    s = bpe_tokenizer.encode(suffix)
    k = len(prefix)
    # room for the suffix and EOS -> EOS appended, counted as refiner token
    ids, mask = splice(prefix, suffix, bpe_tokenizer, max_new_tokens=k + len(s) + 1, eos_id=eos)
    assert ids == prefix + s + [eos] and mask == [0] * k + [1] * (len(s) + 1)
    # exactly fits without EOS -> no EOS
    ids, mask = splice(prefix, suffix, bpe_tokenizer, max_new_tokens=k + len(s), eos_id=eos)
    assert ids == prefix + s and mask == [0] * k + [1] * len(s)
    # too long -> cut to the budget, no EOS
    ids, mask = splice(prefix, suffix, bpe_tokenizer, max_new_tokens=k + 3, eos_id=eos)
    assert ids == prefix + s[:3] and mask == [0] * k + [1] * 3
    # no EOS id known -> none appended
    assert splice(prefix, suffix, bpe_tokenizer, max_new_tokens=500, eos_id=None)[0] == prefix + s
    # a text that spells out the EOS token ends there
    ids, _ = splice(prefix, suffix + "<|endoftext|> junk", bpe_tokenizer, max_new_tokens=500, eos_id=eos)
    assert ids == prefix + s + [eos]
    # zero budget -> the prefix alone
    assert splice(prefix, suffix, bpe_tokenizer, max_new_tokens=k, eos_id=eos) == (prefix, [0] * k)
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        splice(prefix, suffix, bpe_tokenizer, max_new_tokens=k - 1, eos_id=eos)


# ---------- Refiner ----------

class RecordingGenerator:
    """Returns canned completions (the refiner tokenizer's ids of `texts`) and records each call."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, texts, []

    def generate(self, prompts, *, n, temperature, top_p, max_tokens, seed):
        self.calls.append(dict(prompts=prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                               seed=seed))
        return [[Completion(ids=self.tok.encode(t), text=t, finished=True) for t in self.texts[:n]] for _ in prompts]


def test_refiner_prompt_continues_the_assistant_turn(bpe_tokenizer):
    refiner = Refiner(RecordingGenerator(bpe_tokenizer, []), bpe_tokenizer, prompt=refiner_prompt)
    prefix = "First, compute 12 * 4 = 48.\n\n"
    text = bpe_tokenizer.decode(refiner.prompt_ids("Q?", prefix))
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
                    f"<|im_start|>assistant\n{prefix}")
    hint = Refiner(RecordingGenerator(bpe_tokenizer, []), bpe_tokenizer,
                   prompt=lambda q, p: refiner_prompt(q, p, style="hint"))
    assert f"user\nQ?{HINT}<|im_end|>" in bpe_tokenizer.decode(hint.prompt_ids("Q?", prefix))
    assert HINT not in bpe_tokenizer.decode(hint.prompt_ids("Q?", ""))  # nothing to warn about
    plain = make_char_tokenizer()
    plain.chat_template = None
    assert plain.decode(Refiner(None, plain, prompt=refiner_prompt).prompt_ids("Q?", "Step 1")) == "Question: Q?\nSolution:\nStep 1"
    with pytest.raises(ValueError, match="style must be one of"):
        refiner_prompt("Q?", "Step 1", style="fix")


def test_continue_from_one_call_and_per_item_budgets(char_tokenizer):
    gen = RecordingGenerator(char_tokenizer, ["abcdefgh", "xy"])
    refiner = Refiner(gen, char_tokenizer, prompt=refiner_prompt, temperature=0.5, top_p=0.9)
    out = refiner.continue_from(["q1", "q2"], ["p1", ""], n=2, max_tokens=[3, 6], seed=11)
    assert [[text for text, _ in row] for row in out] == [["abc", "xy"], ["abcdef", "xy"]]  # clipped to 3 and 6 tokens
    assert [[finished for _, finished in row] for row in out] == [[False, True], [False, True]]  # a clipped text is cut
    [call] = gen.calls
    assert call["n"] == 2 and call["max_tokens"] == 6 and call["seed"] == 11
    assert call["temperature"] == 0.5 and call["top_p"] == 0.9 and len(call["prompts"]) == 2
    assert refiner.continue_from([], [], n=2, max_tokens=[]) == [] and len(gen.calls) == 1


# ---------- rectify with a fake refiner ----------

class FakeRefiner:
    """Returns fixed suffix texts per item (by question) and records the calls."""

    def __init__(self, by_question):
        self.by_question, self.calls = by_question, []

    def continue_from(self, questions, prefixes, *, n, max_tokens, seed=None):
        self.calls.append(dict(questions=questions, prefixes=prefixes, n=n, max_tokens=max_tokens, seed=seed))
        return [[Suffix(text, True) for text in self.by_question[q][:n]] for q in questions]


def handmade_group(tok):
    """2 groups x 3 failed rollouts with known texts and answers 7 (group 0) and 43 (group 1)."""
    texts = ["Let x = 3.\n\nThen 2x + 1 = 8.\n\nSo \\boxed{8}.", "Let x = 3.\n\nSo \\boxed{9}.",
             "We have x = 3.\n\nThen \\boxed{5}.", "First, compute 12 * 4 = 48.\n\nNext, \\boxed{44}.",
             "First, 12 * 4 = 46.\n\nSo \\boxed{41}.", "The answer is \\boxed{1}."]
    trajs = []
    for i, text in enumerate(texts):
        group = i // 3
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        trajs.append(Trajectory(question=f"question {group}", answer=["7", "43"][group], group=group,
                                prompt_ids=format_prompt(tok, f"question {group}"), response_ids=ids, text=text,
                                steps=[text], step_scores=[0.9, 0.1], cut=1, keep_ratio=0.5, keep_ratio_tokens=0.4))
    return trajs


@pytest.mark.parametrize("merge", ["replace", "append"])
def test_rectify_fake_refiner_accept_reject_and_merge(bpe_tokenizer, merge):
    tok = bpe_tokenizer
    trajs = handmade_group(tok)
    before = copy.deepcopy(trajs)
    k0 = len(tok.encode("Let x = 3.\n\n"))
    k1 = len(tok.encode("First, compute 12 * 4 = 48.\n\n"))
    refiner = FakeRefiner({"question 0": ["Then 2x + 1 = 6, \\boxed{6}.", "Then 2x + 1 = 7, so \\boxed{7}."],
                           "question 1": ["Next, \\boxed{42}.", "Next, \\boxed{45}."]})
    new, traces = rectify(trajs, [(0, k0), (3, k1)], refiner, tok, attempts=2, merge=merge, max_new_tokens=64,
                          grade_fn=boxed_grade, seed=3)

    [call] = refiner.calls  # one batched refiner call for all picks x attempts
    assert call["n"] == 2 and call["seed"] == 3 and call["max_tokens"] == [64 - k0, 64 - k1]
    assert call["prefixes"] == ["Let x = 3.\n\n", "First, compute 12 * 4 = 48.\n\n"]

    fixed = new[0] if merge == "replace" else new[3]
    suffix_ids = tok.encode("Then 2x + 1 = 7, so \\boxed{7}.")
    # a ChatML prompt: the repaired response ends with the turn end <|im_end|>, as a policy sample does
    assert fixed.response_ids == trajs[0].response_ids[:k0] + suffix_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert fixed.offpolicy_mask == [0] * k0 + [1] * (len(suffix_ids) + 1)
    assert fixed.text == "Let x = 3.\n\nThen 2x + 1 = 7, so \\boxed{7}."
    assert (fixed.reward, fixed.correct, fixed.source, fixed.group) == (1.0, True, "rectified", 0)
    assert (fixed.steps, fixed.step_scores, fixed.cut, fixed.keep_ratio, fixed.keep_ratio_tokens) == \
           (trajs[0].steps, trajs[0].step_scores, 1, 0.5, 0.4)
    assert fixed.prompt_ids == trajs[0].prompt_ids

    if merge == "replace":
        assert len(new) == 6 and all(new[i] is trajs[i] for i in range(1, 6))
    else:
        assert len(new) == 7 and all(new[i] is trajs[i] for i in range(3))
        assert all(new[i + 1] is trajs[i] for i in range(3, 6))
    # the rejected group is bit-identical, and the inputs were not mutated
    rejected = new[3:6] if merge == "replace" else new[4:7]
    for got, want in zip(rejected, before[3:6]):
        assert (got.response_ids, got.offpolicy_mask, got.reward, got.text) == \
               (want.response_ids, want.offpolicy_mask, want.reward, want.text)
    assert [t.__dict__ for t in trajs] == [t.__dict__ for t in before]

    assert [set(tr) for tr in traces] == [TRACE_KEYS, TRACE_KEYS]
    t0, t1 = traces
    assert (t0["attempt_correct"], t0["accepted"], t0["reward_before"], t0["reward_after"]) == \
           ([False, True], True, 0.0, 1.0)
    assert (t1["attempt_correct"], t1["accepted"], t1["reward_after"]) == ([False, False], False, 0.0)
    assert t0["mode"] == "scope" and t0["prefix_text"] == "Let x = 3.\n\n" and t0["group"] == 0
    assert t1["suffixes"] == ["Next, \\boxed{42}.", "Next, \\boxed{45}."] and t1["answer"] == "43"
    assert (t0["steps"], t0["scores"], t0["cut"], t0["keep_ratio"], t0["keep_ratio_tokens"]) == \
           (trajs[0].steps, [0.9, 0.1], 1, 0.5, 0.4)


def test_rectify_empty_prefix_is_whole_replacement(bpe_tokenizer):
    trajs = handmade_group(bpe_tokenizer)
    refiner = FakeRefiner({"question 1": ["12 * 4 - 5 = 43, so \\boxed{43}."]})
    new, [trace] = rectify(trajs, [(5, 0)], refiner, bpe_tokenizer, attempts=1, max_new_tokens=64,
                           grade_fn=boxed_grade)
    assert new[5].source == "replaced" and trace["mode"] == "replace" and trace["prefix_text"] == ""
    assert set(new[5].offpolicy_mask) == {1}
    assert new[5].response_ids[-1] == bpe_tokenizer.convert_tokens_to_ids("<|im_end|>") and new[5].finished
    assert refiner.calls[0]["max_tokens"] == [64]


def test_rectify_no_picks_and_bad_arguments(bpe_tokenizer):
    trajs = handmade_group(bpe_tokenizer)
    refiner = FakeRefiner({})
    new, traces = rectify(trajs, [], refiner, bpe_tokenizer, max_new_tokens=64, grade_fn=boxed_grade)
    assert traces == [] and refiner.calls == [] and all(a is b for a, b in zip(new, trajs)) and len(new) == 6
    kw = dict(max_new_tokens=64, grade_fn=boxed_grade)
    with pytest.raises(ValueError, match="merge"):
        rectify(trajs, [(0, 1)], refiner, bpe_tokenizer, merge="both", **kw)
    with pytest.raises(ValueError, match="pick 0 names trajectory 9"):
        rectify(trajs, [(9, 1)], refiner, bpe_tokenizer, **kw)
    with pytest.raises(ValueError, match="pick 1 keeps 999 tokens of trajectory 2"):
        rectify(trajs, [(0, 1), (2, 999)], refiner, bpe_tokenizer, **kw)
    with pytest.raises(ValueError, match="trajectory 0 is picked twice"):
        rectify(trajs, [(0, 1), (0, 2)], refiner, bpe_tokenizer, **kw)


# ---------- rectify end to end with a real Refiner(HFGenerator(tiny model)) ----------

@pytest.mark.parametrize("merge", ["replace", "append"])
def test_rectify_end_to_end_with_hf_refiner(policy_tok, bpe_tokenizer, tiny_causal_lm, merge):
    """Policy (bpe or char tokenizer) sampled by HF; refiner = another tiny model with the BPE tokenizer.
    Group 0's gold is 'any' (the grader accepts anything), group 1's is 'never' (always rejected)."""
    policy = tiny_causal_lm(policy_tok, seed=0)
    trajs = sample_trajectories(policy_tok, policy, ["Let x = 3. Find 2x + 1.", "Compute 12 * 4 - 5."],
                                ["any", "never"], g=3, max_tokens=24)
    before = copy.deepcopy(trajs)
    seen = []

    def grade(text, gold):
        seen.append(text)
        return gold == "any"

    refiner = Refiner(HFGenerator(tiny_causal_lm(bpe_tokenizer, seed=1), bpe_tokenizer), bpe_tokenizer,
                      prompt=refiner_prompt)
    picks = [(1, len(trajs[1].response_ids) // 2), (4, 3)]
    max_new = 40
    new, traces = rectify(trajs, picks, refiner, policy_tok, attempts=3, merge=merge, max_new_tokens=max_new,
                          grade_fn=grade, seed=0)
    again, _ = rectify(trajs, picks, refiner, policy_tok, attempts=3, merge=merge, max_new_tokens=max_new,
                       grade_fn=lambda text, gold: gold == "any", seed=0)

    k = picks[0][1]
    fixed = new[1] if merge == "replace" else new[3]
    assert fixed.source == "rectified" and fixed.reward == 1.0 and fixed.correct
    assert fixed.response_ids[:k] == trajs[1].response_ids[:k]  # the policy's own ids, untouched
    assert len(fixed.response_ids) == len(fixed.offpolicy_mask) <= max_new
    assert fixed.offpolicy_mask == [0] * k + [1] * (len(fixed.response_ids) - k)
    assert fixed.text == policy_tok.decode(fixed.response_ids, skip_special_tokens=True)
    assert fixed.response_ids == again[1 if merge == "replace" else 3].response_ids  # seeded: reproducible
    assert len(seen) == 6  # 2 picks x 3 attempts, all graded
    assert all(s.startswith(traces[0]["prefix_text"]) for s in seen[:3])
    assert [len(tr["suffixes"]) for tr in traces] == [3, 3]
    assert traces[0]["attempt_correct"] == [True] * 3 and traces[1]["attempt_correct"] == [False] * 3
    assert traces[0]["prefix_text"] == policy_tok.decode(trajs[1].response_ids[:k], skip_special_tokens=True)

    layout = [t.group for t in new]
    assert layout == ([0, 0, 0, 1, 1, 1] if merge == "replace" else [0, 0, 0, 0, 1, 1, 1])
    rejected = new[3:6] if merge == "replace" else new[4:7]
    assert all(a is b for a, b in zip(rejected, trajs[3:6]))
    for got, want in zip(rejected, before[3:6]):
        assert (got.response_ids, got.offpolicy_mask, got.reward) == (want.response_ids, want.offpolicy_mask,
                                                                      want.reward)


def test_truncated_refiner_text_gets_no_eos_and_is_judged_truncated(bpe_tokenizer, char_tokenizer):
    """Regression: `Refiner.continue_from` returned text only, so whether the refiner finished was
    lost; a refiner text cut at its budget that re-tokenises SHORTER than the budget in the policy's tokens
    (here the refiner is char-level, the policy BPE) got an EOS appended and was accepted as a finished
    solution. Now `finished` travels with the text and only a finished refiner text gets the EOS."""
    text = "First, compute 12 * 4 = 48. So \\boxed{43}"
    eos = bpe_tokenizer.convert_tokens_to_ids("<|im_end|>")  # the turn end of the policy's ChatML prompt
    trajs = handmade_group(bpe_tokenizer)[:1]
    budget = 200
    for finished in (False, True):
        completion = Completion(ids=char_tokenizer.encode(text), text=text, finished=finished)
        gen = type("Gen", (), {"generate": lambda self, prompts, **kw: [[completion] for _ in prompts]})()
        refiner = Refiner(gen, char_tokenizer, prompt=refiner_prompt)
        [[suffix]] = refiner.continue_from(["q"], [""], n=1, max_tokens=budget)
        assert suffix == (text, finished)
        assert len(bpe_tokenizer.encode(text)) < budget  # shorter than the budget in policy tokens
        new, [trace] = rectify(trajs, [(0, 0)], refiner, bpe_tokenizer, attempts=1, max_new_tokens=budget,
                               grade_fn=lambda t, a: True)
        assert trace["suffix_finished"] == [finished] and trace["accepted"]
        assert (new[0].response_ids[-1] == eos) is finished and new[0].finished is finished
        assert new[0].response_ids[:-1 if finished else None] == bpe_tokenizer.encode(text)
    # splice directly: not finished -> never an EOS, even with room; finished -> EOS when it fits
    ids, mask = splice([], " x = 3", bpe_tokenizer, max_new_tokens=50, eos_id=eos, finished=False)
    assert eos not in ids and mask == [1] * len(ids)
    assert splice([], " x = 3", bpe_tokenizer, max_new_tokens=50, eos_id=eos)[0][-1] == eos
