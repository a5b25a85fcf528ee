"""Held-out fixtures: per problem, inputs drawn from the teacher's seed (`make_<problem>`), the runner that
calls the student's functions on one input (`run_<problem>`, also run by the graded process) and the
comparison of outputs (`matches`)."""
import contextlib
import functools
import importlib
import json
import math
import os
import random
import sys
import types

from .problems import BY_NAME, MODULES, ROOT


WORDS = ["Let", "x", "=", "17.", "Then", "3x", "+", "4", "so", "the", "answer", "is", "\\boxed{55}.", "We",
         "compute", "12", "*", "48", "naïve", "café", "√2", "∑", "ü", "\\frac{1}{2}", "First,", "Next,", "area"]
SEPS = ["\n\n", "\n", " ", "\n \t\n", "\r\n\r\n", "\n\n\n", " "]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _text(rng: random.Random, pieces: int) -> str:
    return "".join(_sentence(rng, rng.randint(1, 6)) + rng.choice(SEPS) for _ in range(pieces)).rstrip(" ")


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # EOS, and the chat turn's start and end
# a byte-level token that finishes "ï" (bytes C3 AF: "Ã" "¯") and runs on into "ve": a step cut after "ï" falls
# inside it, and the "Ã" byte token before it ends inside that character (problem 2's straddle)
STRADDLE, LEAD = "¯ve", "Ã"


def held_out_tokenizer(rng: random.Random):
    """A byte-level BPE (the Qwen2.5 scheme) trained on a corpus drawn from the teacher's seed, with a turn-end
    special token and the straddling token `STRADDLE` (added when training did not merge it: a policy can
    sample any id of its vocabulary, whether or not encoding text ever gives it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=rng.randint(280, 360), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_text(rng, 4) for _ in range(200)], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if STRADDLE not in vocab:
        vocab[STRADDLE] = 1 + max(list(vocab.values()) + [t["id"] for t in spec["added_tokens"]])
    return json.dumps(spec, ensure_ascii=False)


def wrap_tokenizer(spec: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec), eos_token=SPECIALS[0],
                                   pad_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:])


def word_tokenizer(words) -> str:
    """A tokenizer that is not byte-level: SentencePiece-style "▁word" pieces (a word-level vocabulary, the
    Metaspace decoder), whose token strings are not their text. `words`: the pieces' words; "\n" and "\n\n"
    are pieces too. Its spec, for `case_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["\n", "\n\n"] + sorted({"▁" + w for w in words})
    vocab = {"[UNK]": 0, "<eos>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return tok.to_str()


def case_tokenizer(ctx, case):
    """The tokenizer a case runs with: its own (`case["tokenizer"]`, a `word_tokenizer` spec) or the held-out one."""
    spec = case.get("tokenizer")
    return ctx["tokenizer"] if spec is None else _word_tokenizer(spec)


@functools.lru_cache(maxsize=2)
def _word_tokenizer(spec: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec), unk_token="[UNK]", eos_token="<eos>")


def _t(rng, *shape, lo=-1.0, hi=1.0, dtype="float64"):
    import torch

    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=getattr(torch, dtype))


def _mask(rng, *shape, p=0.7):
    return (_t(rng, *shape, lo=0, hi=1) < p).long()


class FakePRM:
    """Step scores fixed per trajectory text (drawn by the maker), truncated to the steps asked for."""

    def __init__(self, scores: dict):
        self.scores, self.calls = scores, 0

    def score_batch(self, questions, steps_lists):
        self.calls += 1
        return [list(self.scores[q][:len(s)]) for q, s in zip(questions, steps_lists)]


class FakeRefiner:
    """Suffixes fixed per question (drawn by the maker): a list of (text, finished) per attempt."""

    def __init__(self, suffixes: dict):
        self.suffixes = suffixes

    def continue_from(self, questions, prefixes, *, n, max_tokens, seed=None):
        from refine import Suffix

        return [[Suffix(*self.suffixes[q][k]) for k in range(n)] for q in questions]


def _graded_float(x):
    return round(float(x), 12)


# each maker: (rng, ctx) -> list of inputs (plain Python, tensors); each runner: (mods, ctx, input) -> output
def make_split_steps(rng, ctx):
    cases = []
    while len(cases) < 12:
        case = {"text": _text(rng, rng.randint(2, 9)), "min_chars": rng.choice([0, 3, 8, 12]),
                "max_steps": rng.choice([3, 5, 40])}
        cases.append(case)
    # the edge classes at every seed: no blank line, so every single newline separates (rule 2's fallback);
    # no newline at all (one step); the empty text
    lines = [_sentence(rng, rng.randint(2, 5)) for _ in range(rng.randint(3, 5))]
    cases += [{"text": "\n".join(lines), "min_chars": 0, "max_steps": 40},
              {"text": " ".join(lines), "min_chars": 0, "max_steps": 40},
              {"text": "", "min_chars": rng.choice([0, 8]), "max_steps": 40}]
    # more steps than max_steps: the tail joins the last step; one step over, and several over with short
    # pieces that merge first (so cutting the pieces, not the steps, to max_steps is wrong)
    for extra, short in ((1, False), (rng.randint(3, 5), True)):
        m = rng.randint(2, 4)
        pieces = ["Then we " + _sentence(rng, rng.randint(3, 5)) + rng.choice(["\n\n", "\r\n\r\n", "\n \t\n"])
                  for _ in range(m + extra)]   # at least 8 non-space characters each
        if short:   # fewer than 8 non-space characters: each merges into the piece after it
            for k in (rng.randrange(m - 1), rng.randrange(m - 1, m + extra - 1)):   # one among the first m - 1
                pieces[k] = rng.choice(["x\n\n", "so\n\n", "12\n\n"])
            pieces += ["Then we " + _sentence(rng, 3) + "\n\n" for _ in range(2)]
        cases.append({"text": "".join(pieces).rstrip(), "min_chars": 8 if short else 0, "max_steps": m})
    return cases


def run_split_steps(m, ctx, c):
    return m.prm.split_steps(c["text"], min_chars=c["min_chars"], max_steps=c["max_steps"])


def make_step_token_spans(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    for k in range(12):
        text = _text(rng, rng.randint(2, 7))
        ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if k % 2 else [])
        text = tok.decode(ids, skip_special_tokens=True)
        if k % 3 == 0:
            import prm
            steps = prm.split_steps(text, min_chars=0)
        else:   # cuts anywhere, also inside tokens and multi-byte characters' tokens
            bounds = sorted({rng.randrange(1, len(text)) for _ in range(rng.randint(1, 5))})
            steps = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
        cases.append({"ids": ids, "steps": steps})
    import prm   # the edge class at every seed: steps that end with their split characters (blank lines)
    text = tok.decode(tok.encode("\n\n".join(_sentence(rng, rng.randint(2, 5)) for _ in range(4)) + "\n",
                                 add_special_tokens=False), skip_special_tokens=True)
    cases.append({"ids": tok.encode(text, add_special_tokens=False), "steps": prm.split_steps(text, min_chars=0)})
    # a character split over byte tokens at a step's end: "Ã" holds the first byte of "ï", `STRADDLE` finishes it
    # and runs on into the next step, so both belong to the later step
    head = tok.encode(_sentence(rng, rng.randint(1, 4)) + " na", add_special_tokens=False)
    tail = tok.encode(" " + _sentence(rng, rng.randint(1, 4)), add_special_tokens=False)
    ids = head + tok.convert_tokens_to_ids([LEAD, STRADDLE]) + tail + [tok.eos_token_id] * rng.randint(0, 1)
    text = tok.decode(ids, skip_special_tokens=True)
    cut = len(tok.decode(head)) + 1   # right after "ï"
    cases.append({"ids": ids, "steps": [text[:cut], text[cut:]]})
    # a tokenizer that is not byte-level ("▁word" pieces): split steps, and cuts inside a piece and after its space
    words = [w for w in WORDS if " " not in w]
    lines = [[rng.choice(words) for _ in range(rng.randint(2, 4))] for _ in range(rng.randint(3, 4))]
    spec = word_tokenizer(w for line in lines for w in line)
    wt = case_tokenizer({}, {"tokenizer": spec})
    ids = []
    for k, line in enumerate(lines):
        sep = [rng.choice(["\n\n", "\n"])] if k < len(lines) - 1 else []
        ids += wt.convert_tokens_to_ids(["▁" + w for w in line] + sep)
    ids.append(wt.eos_token_id)
    text = wt.decode(ids, skip_special_tokens=True)
    second = text.index(" ", text.index(" ") + 1)   # the space that starts the third word's piece
    cases.append({"ids": ids, "steps": prm.split_steps(text, min_chars=0), "tokenizer": spec})
    cases.append({"ids": ids, "steps": [text[:second + 1], text[second + 1:second + 2], text[second + 2:]],
                  "tokenizer": spec})
    return cases


def run_step_token_spans(m, ctx, c):
    return [tuple(s) for s in m.prm.step_token_spans(c["ids"], c["steps"], case_tokenizer(ctx, c))]


def make_first_error(rng, ctx):
    cases = []
    for _ in range(14):
        n = rng.randint(0, 8)
        scores = [None if rng.random() < 0.08 else round(rng.random(), 3) for _ in range(n)]
        g = rng.randint(1, 5)
        cases.append({"scores": scores, "tau": rng.choice([0.3, 0.5, 0.7]),
                      "kappas": [rng.choice([0.0, 0.25, 0.5, 0.75]) for _ in range(g)],
                      "means": [rng.choice([0.2, 0.6, 0.9]) for _ in range(g)],
                      "lengths": [rng.choice([5, 9, 12]) for _ in range(g)]})
    for c in cases[:3]:   # a score exactly τ (not below it: the step passes) ahead of the first one below τ
        at = rng.randint(0, 2)
        c["scores"] = [round(rng.uniform(c["tau"] + 0.01, 1.0), 3) for _ in range(at)] + [c["tau"]] + [
            round(rng.uniform(0.0, c["tau"] - 0.01), 3)] + [round(rng.random(), 3) for _ in range(rng.randint(0, 3))]
    # the edge classes at every seed, on copies of drawn cases: no steps; every step scored and none below τ;
    # an unscored step ahead of the first one below τ (scanning stops there); an unscored step and no error
    for kind in ("empty", "all_correct", "none_before_error", "none_no_error"):
        c = dict(cases[rng.randrange(3, len(cases))])
        tau = c["tau"]

        def good(n):
            return [round(rng.uniform(tau + 0.01, 1.0), 3) for _ in range(n)]
        c["scores"] = {"empty": [], "all_correct": good(rng.randint(2, 6)),
                       "none_before_error": good(rng.randint(0, 2)) + [None, round(rng.uniform(0, tau - 0.01), 3)]
                       + good(rng.randint(0, 2)),
                       "none_no_error": good(rng.randint(1, 3)) + [None] + good(rng.randint(1, 3))}[kind]
        cases.append(c)
    # the pick's tie-breaks: the best κ and prefix mean three times, the longest first, then two of one length
    # (the shorter wins, then the earlier), and a worse failure last
    k, mean, n = rng.choice([0.25, 0.5, 0.75]), rng.choice([0.6, 0.9]), rng.randint(5, 9)
    cases.append(dict(cases[rng.randrange(len(cases))], kappas=[k, k, k, k - 0.25], means=[mean, mean, mean, 1.0],
                      lengths=[n + rng.randint(1, 5), n, n, 1]))
    return cases


def run_first_error(m, ctx, c):
    p = m.prm
    cut = p.cut_point(c["scores"], c["tau"])
    return (p.first_error(c["scores"], c["tau"]), cut, p.keep_ratio(cut, len(c["scores"])),
            p.select_candidate(c["kappas"], c["means"], c["lengths"]))


def make_splice(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    eos, turn_end = tok.eos_token_id, tok.convert_tokens_to_ids(SPECIALS[2])
    eos_text, end_text = tok.decode([eos]), SPECIALS[2]
    for k in range(12):
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        suffix = _text(rng, rng.randint(1, 3)) + rng.choice(["", "", eos_text + " tail", " <|im_start|> x"])
        cases.append({"prefix_ids": prefix, "suffix_text": suffix, "finished": rng.random() < 0.7,
                      "max_new_tokens": len(prefix) + rng.choice([2, 6, 40, 400]),
                      "eos_id": rng.choice([eos, eos, turn_end, None])})
    for room in (0, 0, 1):   # finished suffixes exactly the budget long (no room for EOS) and one token shorter
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        suffix = _text(rng, rng.randint(1, 3))
        n = len(tok(suffix, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        cases.append({"prefix_ids": prefix, "suffix_text": suffix, "finished": True,
                      "max_new_tokens": len(prefix) + n + room, "eos_id": eos})
    for _ in range(2):   # the refiner spelled out EOS but did not stop by itself: its text ends there, with EOS
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        cases.append({"prefix_ids": prefix, "suffix_text": _text(rng, 2) + eos_text + " tail", "finished": False,
                      "max_new_tokens": len(prefix) + 400, "eos_id": eos})
    # the turn's end is not the tokenizer's EOS (a chat model's <|im_end|>): it is what ends the suffix, spelled
    # or appended, and the tokenizer's EOS text is plain text; no end id at all (eos_id None): nothing is
    # appended and no text ends the suffix
    for eos_id, suffix, finished in ((turn_end, _text(rng, 2), True),
                                     (turn_end, _text(rng, 2) + end_text + " tail", False),
                                     (turn_end, _text(rng, 1) + eos_text + " " + _text(rng, 1), True),
                                     (None, _text(rng, 2), True),
                                     (None, _text(rng, 1) + eos_text + " " + _text(rng, 1), True)):
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        cases.append({"prefix_ids": prefix, "suffix_text": suffix, "finished": finished,
                      "max_new_tokens": len(prefix) + 400, "eos_id": eos_id})
    cases += [dict(_seam_case(rng, tok, merged), eos_id=eos) for merged in (False, False, True, True)]
    return cases


def _seam_case(rng, tok, merged: bool) -> dict:
    """A splice whose prefix is not what re-encoding its text gives: ids of two pieces encoded apart (`merged`
    False), or a prefix that stops inside a word the suffix finishes (True: encoding prefix text + suffix
    merges across the seam). Decoding and re-encoding the prefix changes the response either way."""
    for _ in range(200):
        word = rng.choice([w for w in WORDS if len(w) >= 4])
        k = rng.randint(1, len(word) - 1)
        head = _text(rng, 1).rstrip() + " " + word[:k]
        if merged:
            prefix, suffix = tok.encode(head, add_special_tokens=False), word[k:] + " " + _text(rng, 1)
            whole = tok.encode(head + suffix, add_special_tokens=False)
            if whole[:len(prefix)] != prefix:
                break
        else:
            prefix = tok.encode(head, add_special_tokens=False) + tok.encode(word[k:], add_special_tokens=False)
            suffix = " " + _text(rng, 1)
            if tok.encode(tok.decode(prefix), add_special_tokens=False) != prefix:
                break
    else:
        raise ValueError("no seam case found for this tokenizer; try another seed")
    return {"prefix_ids": prefix, "suffix_text": suffix, "finished": True, "max_new_tokens": len(prefix) + 400}


def run_splice(m, ctx, c):
    tok = ctx["tokenizer"]
    return m.refine.splice(c["prefix_ids"], c["suffix_text"], tok, max_new_tokens=c["max_new_tokens"],
                           eos_id=c["eos_id"], finished=c["finished"])


def make_group_advantages(rng, ctx):
    cases = []
    for k in range(10):
        g, b = rng.randint(2, 6), rng.randint(1, 4)
        rewards = [float(rng.random() < 0.5) if k % 2 else round(rng.uniform(-1, 2), 3) for _ in range(g * b)]
        rewards[0], rewards[1] = 1.0, 0.0   # no all-equal first group: a constant answer must fail
        cases.append({"rewards": rewards, "group_size": g, "scale_std": k % 3 == 0})
    for b in (1, 3):   # groups of one with scale_std: no spread, advantage 0, never NaN (std of one value is NaN)
        cases.append({"rewards": [round(rng.uniform(-1, 2), 3) for _ in range(b)], "group_size": 1, "scale_std": True})
    return cases


def run_group_advantages(m, ctx, c):
    import torch
    return m.grpo.group_advantages(torch.tensor(c["rewards"]), c["group_size"], scale_std=c["scale_std"])


def _trajectories(rng, tok, n_groups, g):
    out = []
    for b in range(n_groups):
        answer = str(rng.randint(2, 60))
        for j in range(g):
            correct = rng.random() < 0.3
            text = _text(rng, rng.randint(1, 5)) + f" \\boxed{{{answer if correct else int(answer) + 1}}}"
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            out.append({"question": f"q{b}-{rng.randrange(10**6)}", "answer": answer, "group": b,
                        "prompt_ids": tok.encode(f"Q{b}:", add_special_tokens=False), "response_ids": ids,
                        "text": tok.decode(ids, skip_special_tokens=True), "correct": correct,
                        "reward": float(correct)})
    return out


def make_scope_step(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    for k in range(8):
        n_groups, g = rng.randint(2, 4), rng.randint(2, 4)
        trajs = _trajectories(rng, tok, n_groups, g)
        trajs[0]["correct"], trajs[0]["reward"] = False, 0.0   # at least one failure to localise
        scores = {t["question"]: [round(rng.random() * 0.6 + 0.4 * (rng.random() < 0.7), 3) for _ in range(40)]
                  for t in trajs}
        suffixes = {t["question"]: [(f" so \\boxed{{{t['answer'] if rng.random() < 0.6 else 0}}}", rng.random() < 0.8)
                                    for _ in range(3)] for t in trajs}
        cases.append({"trajs": trajs, "scores": scores, "suffixes": suffixes, "n_groups": n_groups,
                      "mode": ["scope", "replace", "grpo", "prm-reward", "scope", "scope", "scope", "replace"][k],
                      "rectify_groups": rng.choice(["any", "all-fail"]), "merge": rng.choice(["replace", "append"]),
                      "tau": rng.choice([0.5, 0.7]), "attempts": rng.choice([1, 2, 3]),
                      "adv_std": rng.random() < 0.3})
    # a tie in κ (the cut at step 2 of 4) whose kept prefixes rank one way, and both the whole responses and the
    # kept prefixes with the first wrong step counted the other: a keeps [0.95, 0.95] then scores [0.0, 0.1], b keeps
    # [0.8, 0.8] then [0.45, 0.99]. The pick is a (prefix mean 0.95 > 0.8); with the first wrong step b (0.68 >
    # 0.63), over the whole response b (0.76 > 0.5)
    for c in cases[4:6]:
        _tie_in_group_0(rng, tok, c, [0.95, 0.95, 0.0, 0.1], [0.8, 0.8, 0.45, 0.99])
        c["tau"] = rng.choice([0.5, 0.7])
    # tiebreak "index": a tie in κ and in the prefix mean, the first failure the longer one (the default
    # tie-break picks the second, "index" the first)
    c = dict(cases[6], trajs=[dict(t) for t in cases[6]["trajs"]], scores=dict(cases[6]["scores"]),
             tiebreak="index")
    _tie_in_group_0(rng, tok, c, [0.9, 0.9, 0.1, 0.1], [0.9, 0.9, 0.1, 0.1], longer_first=True)
    cases.append(c)
    # no PRM (--prm none, mode grpo): nothing is scored, located or picked
    cases.append(dict(cases[2], trajs=[dict(t) for t in cases[2]["trajs"]], scores=None, mode="grpo"))
    return cases


def _tie_in_group_0(rng, tok, case, scores_a, scores_b, longer_first=False) -> None:
    """Make group 0 of `case` hold two failures a and b of 4 steps each (PRM scores `scores_a`, `scores_b`; a the
    longer in tokens when `longer_first`) and successes, in mode scope with every group eligible."""
    import prm

    group = [t for t in case["trajs"] if t["group"] == 0]
    for t in group:
        t["correct"], t["reward"] = True, 1.0
    made = []
    for t, scores in zip(group[:2], (scores_a, scores_b)):
        while True:
            n = rng.randint(3, 5) if not longer_first else (6 if not made else 3)
            text = "\n\n".join(_sentence(rng, n) for _ in range(4)) + f" \\boxed{{{int(t['answer']) + 1}}}"
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            if len(prm.split_steps(text)) == 4 and (not made or not longer_first or len(ids) < made[0]):
                break
        made.append(len(ids))
        t.update(response_ids=ids, text=tok.decode(ids, skip_special_tokens=True), correct=False, reward=0.0)
        case["scores"][t["question"]] = list(scores)
    case.update(mode="scope", rectify_groups="any")


def run_scope_step(m, ctx, c):
    """Steps 3-6 on stored rollouts, with a fake PRM and refiner: what each function returns and sets."""
    from harness.data.grader import grade
    tok = ctx["tokenizer"]
    args = m.scope.Args(toy=True, mode=c["mode"], rectify_groups=c["rectify_groups"], merge=c["merge"], tau=c["tau"],
                        refine_attempts=c["attempts"], max_new_tokens=400, group_size=len(c["trajs"]) // c["n_groups"],
                        prompts_per_step=c["n_groups"], adv_std=c["adv_std"],
                        select_tiebreak=c.get("tiebreak", "length"))
    trajs = [m.refine.Trajectory(**{k: (list(v) if isinstance(v, list) else v) for k, v in t.items()}) for t in c["trajs"]]
    prm = None if c["scores"] is None else FakePRM(c["scores"])   # None: --prm none
    m.prm.locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    located = [(t.steps, t.step_scores, t.cut, _graded_float(t.keep_ratio) if t.keep_ratio is not None else None,
                _graded_float(t.keep_ratio_tokens) if t.keep_ratio_tokens is not None else None, t.prefix_len)
               for t in trajs]
    picks = [tuple(p) for p in m.prm.select_failures(trajs, range(c["n_groups"]), args.mode, args.rectify_groups,
                                                     args.select_tiebreak)]
    merged, traces = m.refine.rectify(trajs, picks, FakeRefiner(c["suffixes"]), tok, attempts=args.refine_attempts,
                                      merge=args.merge, max_new_tokens=args.max_new_tokens, grade_fn=grade, seed=0)
    unavailable = False   # the engine's (harness/run/wiring.py Run.refine_phase), not the student's
    adv = m.grpo.group_advantages([t.reward for t in merged], groups=[t.group for t in merged], scale_std=c["adv_std"])
    merged = [(t.group, t.response_ids, t.offpolicy_mask, t.reward, t.source) for t in merged]
    return {"located": located, "picks": picks, "merged": merged,
            "traces": [(tr["group"], tr["accepted"], tr["mode"]) for tr in traces], "unavailable": unavailable,
            "advantages": adv}


def make_build_batch(rng, ctx):
    cases = []
    for _ in range(8):
        n = rng.randint(1, 5)
        prompts = [[rng.randint(3, 90) for _ in range(rng.randint(1, 5))] for _ in range(n)]
        responses = [[rng.randint(3, 90) for _ in range(rng.randint(0, 6))] for _ in range(n)]
        masks = [None if rng.random() < 0.3 else [int(rng.random() < 0.5) for _ in r] for r in responses]
        cases.append({"prompts": prompts, "responses": responses, "masks": masks,
                      "adv": [round(rng.uniform(-1, 1), 3) for _ in range(n)], "pad": rng.choice([0, 1, 2])})
    return cases


def run_build_batch(m, ctx, c):
    return m.grpo.build_batch(c["prompts"], c["responses"], c["masks"], c["adv"], c["pad"])


def make_logprob_entropy(rng, ctx):
    # the last case has as many positions as vocabulary entries (random, so not symmetric): a log_softmax over
    # the wrong dimension has the right shape there and wrong values
    cases = [{"logits": _t(rng, rng.randint(1, 3), 11 if k == 8 else rng.randint(1, 5), 11, lo=-4, hi=4,
                           dtype=rng.choice(["float32", "float64"])), "targets_seed": rng.randrange(2**31),
              "entropy_grad": k % 2 == 1} for k in range(9)]
    # logits past ±100 (float32: exp overflows past 88 and underflows below −103; float64: past ±709), so
    # softmax before the log, or exp before the normalising sum, gives −inf, inf or NaN where log_softmax does not
    for dtype, scale in (("float32", 150.0), ("float64", 1000.0)):
        cases.append({"logits": _t(rng, rng.randint(1, 2), rng.randint(2, 4), 11, lo=-scale, hi=scale, dtype=dtype),
                      "targets_seed": rng.randrange(2**31), "entropy_grad": rng.random() < 0.5})
    # float64 logits 1e5 apart from 0 and 0.04 from each other: float32 holds them to 0.008 (its spacing at 1e5),
    # so log-probs computed in float32 and cast back are off by ~1e-3, ten times the tolerance
    cases.append({"logits": 1e5 + _t(rng, 1, rng.randint(2, 4), 11, lo=-0.02, hi=0.02),
                  "targets_seed": rng.randrange(2**31), "entropy_grad": True})
    return cases


def run_logprob_entropy(m, ctx, c):
    import torch

    logits = c["logits"].clone().requires_grad_(True)
    g = torch.Generator().manual_seed(c["targets_seed"])
    targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g)
    taken, ent = m.grpo.logprobs_and_entropy(logits, targets, entropy_grad=c["entropy_grad"])
    (taken.sum() + (ent.sum() if ent.requires_grad else 0)).backward()
    direct = m.grpo.entropy_from_logprobs(torch.log_softmax(c["logits"], -1))
    return taken.detach(), ent.detach(), logits.grad, direct


def make_clipped_surrogate(rng, ctx):
    out = []
    for _ in range(8):
        n, length = rng.randint(1, 4), rng.randint(2, 6)
        logp = _t(rng, n, length, lo=-3, hi=-0.05)
        out.append({"logp": logp, "old": logp + 0.5 * _t(rng, n, length), "adv": _t(rng, n, lo=-2, hi=2),
                    "mask": _mask(rng, n, length), "eps": rng.choice([0.1, 0.2, 0.3])})
    for c in out[::2]:   # junk off the mask (a padded or refiner position): must not reach the loss or gradient
        c["mask"][0, 0] = 0
        c["old"] = _junk_off(c["old"], c["mask"], rng)
    for c in out[1::3]:   # π_old handed over still attached to a graph: the loss must not differentiate it
        c["old_grad"] = True
    # ε other than the default 0.2, each with a token whose ρ the clip at ε binds on and the clip at 0.2 would
    # not (ρ = 1.15 at ε = 0.1, A > 0), or the other way round (ρ = 1.25 at ε = 0.3, A > 0)
    for c, eps, rho in zip(out[:2], (0.1, 0.3), (1.15, 1.25)):
        c["eps"] = eps
        c["mask"][-1, -1] = 1
        c["old"][-1, -1] = c["logp"][-1, -1] - math.log(rho)
        c["adv"][-1] = 0.5 + abs(float(c["adv"][-1]))
    return out


def _junk_off(old, mask, rng):
    """`old` with −inf, NaN or −1e4 where `mask` is 0: exp of the log-ratio there overflows or is NaN."""
    import torch

    junk = torch.tensor([float("-inf"), float("nan"), -1e4], dtype=old.dtype)
    pick = torch.randint(0, 3, old.shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return torch.where(mask.bool(), old, junk[pick])


def run_clipped_surrogate(m, ctx, c):
    logp = c["logp"].clone().requires_grad_(True)
    old = c["old"].clone().requires_grad_(c.get("old_grad", False))
    loss, ratio, clipped = m.grpo.clipped_surrogate(logp, old, c["adv"], c["mask"], c["eps"])
    loss.sum().backward()
    return loss.detach(), ratio.detach(), clipped, logp.grad, old.grad is None or not bool(old.grad.any())


def make_shaped_offpolicy(rng, ctx):
    out = []
    for _ in range(8):
        n, length = rng.randint(1, 4), rng.randint(2, 6)
        out.append({"logp": _t(rng, n, length, lo=-4, hi=-0.01), "adv": _t(rng, n, lo=-2, hi=2),
                    "mask": _mask(rng, n, length), "gamma": rng.choice([0.05, 0.1, 0.5])})
    for c, gamma in zip(out[:2], (0.05, 0.5)):   # γ other than the default 0.1, on a masked token
        c["gamma"] = gamma
        c["mask"][0, 0] = 1
    return out


def run_shaped_offpolicy(m, ctx, c):
    logp = c["logp"].clone().requires_grad_(True)
    loss, shaped = m.grpo.shaped_offpolicy_loss(logp, c["adv"], c["mask"], c["gamma"])
    loss.sum().backward()
    return loss.detach(), shaped.detach(), logp.grad


def make_policy_loss(rng, ctx):
    import torch

    out = []
    for k in range(10):
        n, length = rng.randint(2, 5), rng.randint(3, 8)
        resp = _mask(rng, n, length, p=0.8)
        resp[0, 1] = 1
        logp = _t(rng, n, length, lo=-3, hi=-0.05)
        out.append({"logp": logp, "old": logp + 0.4 * _t(rng, n, length), "adv": _t(rng, n, lo=-2, hi=2),
                    "resp": resp, "off": _mask(rng, n, length, p=0.4) * resp,
                    "ref": logp + 0.3 * _t(rng, n, length) if k % 2 else None,
                    "ent": 3 * _t(rng, n, length, lo=0, hi=1) if k % 3 else None,
                    "kw": {"clip_eps": rng.choice([0.2, 0.3, float("inf")]), "shaping_gamma": rng.choice([0.1, 0.3]),
                           "loss_agg": rng.choice(["constant", "token-mean"]), "max_new_tokens": length + 2,
                           "kl_coef": 0.05, "entropy_coef": 0.01,
                           "offpolicy_credit": "unit" if k % 4 == 3 else "shaped"}})
    for c in out[1::3]:   # junk outside the response
        c["old"] = _junk_off(c["old"], c["resp"], rng)
    for c in out[::3]:   # vLLM rollouts: the truncated importance weight of the policy's tokens
        c["is_weight"] = _t(rng, *c["logp"].shape, lo=0.3, hi=2.0)
    # settings other than the defaults, each where it changes the loss: ε = 0.1 on a policy token with ρ = 1.15,
    # A > 0 (the clip at 0.1 binds, at 0.2 it would not); γ = 0.5 on a refiner token; unit credit on a refiner token
    c = out[0]
    c["kw"]["clip_eps"], c["off"][0, 1] = 0.1, 0
    c["old"][0, 1] = c["logp"][0, 1] - math.log(1.15)
    c["adv"][0] = 0.5 + abs(float(c["adv"][0]))
    out[1]["kw"].update(shaping_gamma=0.5, offpolicy_credit="shaped")
    for c in (out[1], out[3], out[7]):
        c["off"][0, 1] = 1
    # a token-mean batch without a response token (every row empty): Z is at least 1, the loss 0, never 0/0
    c = dict(out[rng.randrange(len(out))], kw=dict(out[0]["kw"], loss_agg="token-mean"))
    c.update(resp=torch.zeros_like(c["resp"]), off=torch.zeros_like(c["off"]))
    out.append(c)
    return out


def run_policy_loss(m, ctx, c):
    from harness.engines.trainer import loss_metrics   # the engine's, not an exercise
    logp = c["logp"].clone().requires_grad_(True)
    ent = None if c["ent"] is None else c["ent"].clone().requires_grad_(True)
    loss, terms = m.grpo.policy_loss(logp, c["old"], c["adv"], c["resp"], c["off"], ref_logp=c["ref"], entropy=ent,
                                     is_weight=c.get("is_weight"), **c["kw"])
    loss.backward()
    z = m.grpo.loss_normaliser(c["resp"], c["kw"]["loss_agg"], c["kw"]["max_new_tokens"])
    return (loss.detach(), logp.grad, None if ent is None else ent.grad,
            {k: _graded_float(v) for k, v in loss_metrics(terms).items()}, _graded_float(z))


def make_update(rng, ctx):
    import grpo
    import torch

    cases = []
    for k in range(6):
        n = rng.randint(3, 6)
        prompts = [[rng.randint(3, 60) for _ in range(rng.randint(1, 4))] for _ in range(n)]
        responses = [[rng.randint(3, 60) for _ in range(rng.randint(1, 6))] for _ in range(n)]
        masks = [[int(rng.random() < 0.4) for _ in r] for r in responses]
        adv = [round(rng.uniform(-1, 1), 3) for _ in range(n)]
        if k in (1, 4):   # row 0 all the policy's, with A > 0: the clip binds on its tokens at ρ = 1.1 > 1 + ε
            masks[0], adv[0] = [0] * len(masks[0]), 0.5 + abs(adv[0])
        if k in (3, 5):   # a refiner token, where γ and the credit act
            masks[0][0] = 1
        if k == 4:   # row 1 with a policy token and |A| ≥ 0.5: where the TIS cap binds
            masks[1][0], adv[1] = 0, -0.5 - abs(adv[1])
        batch = grpo.build_batch(prompts, responses, masks, adv, 0)
        seed, shape = rng.randrange(2**31), batch["input_ids"].shape
        if k in (1, 4):   # several optimizer steps on one rollout batch: π_old stale by ρ = 1.1 on every token
            batch["old_logp"] = (batch["response_mask"] * (_model_logp(seed, batch) - math.log(1.1))).float()
        if k == 2:
            batch["ref_logp"] = batch["response_mask"] * (-4.0 + 0.5 * _t(rng, *shape, dtype="float32"))
        if k == 4:   # vLLM rollouts: the sampler's log-probs (one unknown), weighted by the truncated IS weight
            # w = min(exp(π_old − π_sampler), cap 1.5): 1.3 on even rows (against this forward's π it would be 1.43),
            # the cap on odd rows (exp gives 1.6)
            gap = torch.tensor([math.log(1.3) if i % 2 == 0 else math.log(1.6) for i in range(n)]).unsqueeze(1)
            batch["sampler_logp"] = batch["response_mask"] * (batch["old_logp"] - gap)
            batch["sampler_mask"] = batch["response_mask"].clone()
            batch["sampler_mask"][0, batch["sampler_mask"][0].nonzero()[0]] = 0
        # settings other than the defaults: ε = 0.05 (ρ = 1.1 clips at it, not at 0.2), γ = 0.5, unit credit
        cases.append({"batch": batch, "model_seed": seed, "mb": rng.choice([1, 2, n]),
                      "kw": {"loss_agg": rng.choice(["constant", "token-mean"]), "max_new_tokens": 8,
                             "kl_coef": 0.1 if k == 2 else 0.0, "entropy_coef": 0.01 if k == 3 else 0.0,
                             "clip_eps": 0.05 if k == 1 else 0.2, "max_grad_norm": 1.0,
                             **({"tis_cap": 1.5} if k == 4 else {}), **({"shaping_gamma": 0.5} if k == 3 else {}),
                             **({"offpolicy_credit": "unit"} if k == 5 else {})}})
    # without old_logp (ρ = 1 where the gradient is taken, no clip binds): once with the student's own
    # clipped_surrogate (an update and a surrogate that both leave π_old attached to logp's graph train nothing)
    # and once with `_attached_surrogate`, which differentiates π_old as update hands it over
    for surrogate in ("own", "attached"):
        c = dict(cases[0], model_seed=rng.randrange(2**31), surrogate=surrogate)
        c["batch"] = {k: v for k, v in c["batch"].items() if k != "old_logp"}
        cases.append(c)
    return cases


def _update_model(seed: int):
    """The tiny float64 Qwen2 policy that an update case trains, from its seed."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).double()


def _model_logp(seed: int, batch: dict):
    """The log-probs (N, L), 0 off the response, that the case's model gives the batch's tokens before any step."""
    import grpo

    logp, _ = grpo.token_logprobs(_update_model(seed), batch["input_ids"], batch["attention_mask"],
                                  batch["response_mask"], len(batch["input_ids"]))
    return logp


def _attached_surrogate(logp, old_logp, advantages, mask, clip_eps):
    """ρ = exp(logp − old_logp) with old_logp as given (not detached: an old_logp that is logp itself, not
    detached, cancels its gradient), per-token −ρA on the mask; no clip (the grading case has ρ = 1)."""
    import torch

    mask = mask.bool()
    ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
    loss = torch.where(mask, -ratio * advantages.to(logp.dtype).unsqueeze(1), torch.zeros_like(logp))
    return loss, ratio, torch.zeros_like(mask)


def run_update(m, ctx, c):
    import torch

    model = _update_model(c["model_seed"])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = {k: v.clone() for k, v in c["batch"].items()}
    for k in ("old_logp", "ref_logp"):
        if k in batch:
            batch[k] = batch[k].double()
    given = m.grpo.clipped_surrogate
    if c.get("surrogate") == "own":
        own = ctx["own_grpo"].clipped_surrogate

        def surrogate(*a, **kw):   # the student's own; the reference's where theirs is still a stub
            try:
                return own(*a, **kw)
            except NotImplementedError:
                return given(*a, **kw)
        m.grpo.clipped_surrogate = surrogate
    elif c.get("surrogate") == "attached":
        m.grpo.clipped_surrogate = _attached_surrogate
    try:
        stats = m.grpo.update(model, opt, batch, micro_batch_size=c["mb"], **c["kw"])
    finally:
        m.grpo.clipped_surrogate = given
    delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return {k: _graded_float(v) for k, v in stats.items()}, delta


PROBLEMS = {name: (globals()[f"make_{name}"], globals()[f"run_{name}"]) for name in BY_NAME}


def matches(got, want, rtol=1e-4, atol=1e-6) -> bool:
    """Whether a submitted output equals the reference's: tensors by shape, dtype and value (rtol/atol), floats by
    value, containers element by element, anything else by ==."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            return False
        if got.dtype != want.dtype:   # float64 in, float64 out: a float32 answer is within 1e-4 and still wrong
            return False
        if want.dtype == torch.bool or not want.is_floating_point():
            return bool(torch.equal(got, want))
        return bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol,
                                                               equal_nan=True))
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return got == want and type(got) is type(want)
    if isinstance(want, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=rtol,
                                                                                            abs_tol=atol)
    if isinstance(want, int):
        return isinstance(got, int) and not isinstance(got, bool) and got == want
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(matches(got[k], want[k], rtol, atol) for k in want)
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
            matches(a, b, rtol, atol) for a, b in zip(got, want))
    return got == want


def constant_like(want, value=0):
    """`want` with every number (tensor entry, float, int) replaced by `value` and every string by "": a trivially
    constant answer."""
    import torch

    if isinstance(want, torch.Tensor):
        return torch.full_like(want, value) if want.dtype != torch.bool else torch.zeros_like(want)
    if isinstance(want, str):
        return ""
    if isinstance(want, bool) or want is None:
        return want
    if isinstance(want, (int, float)):
        return type(want)(value)
    if isinstance(want, dict):
        return {k: constant_like(v, value) for k, v in want.items()}
    if isinstance(want, (list, tuple)):
        return type(want)(constant_like(v, value) for v in want)
    return want


def _loaded_with_the_method(name: str) -> bool:
    """The modules `load_modules` imports afresh: the five method files and harness/, whose wiring.py and
    toy.py import names from them at import time (a harness shared between two sets would stay bound to
    whichever set imported it first)."""
    return name in MODULES or name == "harness" or name.startswith("harness.")


def load_modules(root: str):
    """grpo, prm, refine, scope and eval imported from `root` as a fresh set, with a harness/ of their own
    (the reference's code, bound to these files), and the previously imported modules put back afterwards, so
    nothing imported later in this process sees the set."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if _loaded_with_the_method(n)}
    sys.path.insert(0, os.path.abspath(root))
    try:
        mods = {n: importlib.import_module(n) for n in MODULES}
        for n, mod in mods.items():
            if os.path.dirname(os.path.abspath(mod.__file__)) != os.path.abspath(root):
                raise ValueError(f"{n} was imported from {mod.__file__}, not from {root}")
        return types.SimpleNamespace(**mods)
    finally:
        sys.path.remove(os.path.abspath(root))
        for n in [n for n in sys.modules if _loaded_with_the_method(n)]:
            sys.modules.pop(n)
        sys.modules.update(saved)


def drawn(seed, names, spec: str, root: str = ROOT, label: str = "seed", watch=None):
    """Yield (problem, cases, outputs) for each of `names`: its inputs drawn from `seed` with the tokenizer `spec`
    and the reference's outputs on them, the reference's modules standing in sys.modules while the makers and the
    runners call them. `watch(ref, problem, tokenizer)`, a context manager around each problem's reference run (the
    grader records the calls it makes there). ValueError, naming `label` and `seed`, when a problem's cases do not
    reject a constant answer."""
    ref = load_modules(root)
    saved = {n: sys.modules.get(n) for n in MODULES}
    sys.modules.update({n: getattr(ref, n) for n in MODULES})   # makers call the reference directly
    tok = wrap_tokenizer(spec)
    ctx = {"tokenizer": tok, "own_grpo": ref.grpo}
    try:
        for name in names:
            make, run = PROBLEMS[name]
            cases = make(random.Random(f"{seed}-{name}"), ctx)
            with watch(ref, name, tok) if watch else contextlib.nullcontext():
                outputs = [run(ref, ctx, c) for c in cases]
            if all(matches(o, outputs[0]) for o in outputs) or all(matches(constant_like(o), o) for o in outputs):
                raise ValueError(f"{label} {seed}: the cases of {name} do not reject a constant answer")
            yield name, cases, outputs
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


def write_fixtures(out_dir: str, seed: int, only=None, root: str = ROOT) -> dict:
    """Draw the held-out inputs from `seed`, run the reference on them, write `<problem>.pt` files and
    index.json into `out_dir` (new or empty). Returns {problem: number of cases}."""
    import torch

    names = list(BY_NAME) if only is None else list(only)
    unknown = set(names) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown exercise(s) {sorted(unknown)}; known: {', '.join(BY_NAME)}")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--fixtures {out_dir} exists and is not empty; choose a new folder")
    os.makedirs(out_dir, exist_ok=True)
    spec = held_out_tokenizer(random.Random(seed))
    counts = {}
    try:
        for name, cases, outputs in drawn(seed, names, spec, root):
            torch.save({"problem": name, "seed": seed, "cases": cases, "outputs": outputs},
                       os.path.join(out_dir, f"{name}.pt"))
            counts[name] = len(cases)
    except ValueError as err:
        raise ValueError(f"{err}; try another seed") from None
    with open(os.path.join(out_dir, "index.json"), "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "tokenizer": spec, "problems": counts}, f)
    return counts

