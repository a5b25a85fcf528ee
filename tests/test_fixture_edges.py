"""The held-out fixtures (tools/course/fixtures.py) hold every edge class at every seed, by construction, and a
plausible wrong solution at each edge loses its problem's points at every seed and fails its problem's own check.

- `EDGES`: each edge class, its problem and a test of one case; each holds for some case drawn at seeds 1–20.
- `MUTANTS`: each wrong solution, its problem, its edits of the reference (function, text, replacement) and the
  check of the problem's own (a test the course maps to it) that fails on it. A mutant is compiled from the
  reference function's source with the edits and put in its place (the module's attribute and every module of
  the repository that imported the name); the problem's runner then runs each seed's cases, compared with the
  reference's outputs on the same cases by `fixtures.matches`, as the grader compares.

The cases are drawn as `write_fixtures` draws them (the tokenizer from `random.Random(seed)`, each problem's
cases from `random.Random(f"{seed}-{problem}")`), in this process.
"""
import contextlib
import importlib
import inspect
import itertools
import json
import os
import random
import sys
import textwrap
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import prm  # noqa: E402
import refine  # noqa: E402
import scope  # noqa: E402
from tools.course import fixtures, problems  # noqa: E402

SEEDS = range(1, 21)
MODS = types.SimpleNamespace(grpo=grpo, prm=prm, refine=refine, scope=scope, eval=importlib.import_module("eval"))
C = problems.CHECKS
pytestmark = pytest.mark.xdist_group("fixture_edges")   # one worker builds the seeds' cases once


# ---------------------------------------------------------------------------------------------------
# the edge classes: (problem, does this case hold it? (case, ctx) -> bool)
# ---------------------------------------------------------------------------------------------------
def _past_max_steps(c, ctx):
    return len(prm.split_steps(c["text"], min_chars=c["min_chars"], max_steps=10**6)) > c["max_steps"]


def _short_pieces_past_max_steps(c, ctx):
    pieces = prm._cut_after(c["text"], prm._blank_line_ends(c["text"]))
    return c["min_chars"] > 0 and _past_max_steps(c, ctx) and len(pieces) > len(
        prm.split_steps(c["text"], min_chars=c["min_chars"], max_steps=10**6))


def _straddled_character(c, ctx):
    """A step starts inside a token that finishes a character whose first bytes the token before holds."""
    if "tokenizer" in c:
        return False
    last, pending = prm._char_reach(ctx["tokenizer"], c["ids"], "".join(c["steps"]))
    boundary = 0
    for step in c["steps"][:-1]:
        boundary += len(step)
        t = next((i for i, x in enumerate(last) if x >= boundary), len(last))
        if 0 < t < len(last) and pending[t - 1] and last[t] > boundary:
            return True
    return False


def _not_byte_level(c, ctx):
    return "tokenizer" in c and json.loads(c["tokenizer"])["decoder"]["type"] != "ByteLevel"


def _turn_end(c, ctx):
    tok = ctx["tokenizer"]
    return c["eos_id"] is not None and c["eos_id"] != tok.eos_token_id and c["finished"]


def _spelled_turn_end(c, ctx):
    return _turn_end(c, ctx) or (c["eos_id"] is not None and c["eos_id"] != ctx["tokenizer"].eos_token_id
                                 and ctx["tokenizer"].decode([c["eos_id"]]) in c["suffix_text"])


def _tie_flipped(c, whole: bool) -> bool:
    """Two failures of a group tied in κ whose kept prefixes rank one way and whose prefixes with the first wrong
    step (`whole`: whose whole responses) rank the other."""
    if c["scores"] is None or c["mode"] != "scope":
        return False
    seen = {}
    for t in c["trajs"]:
        if t["correct"]:
            continue
        scores = c["scores"][t["question"]][:len(prm.split_steps(t["text"]))]
        cut = prm.cut_point(scores, c["tau"])
        other = scores if whole else scores[:cut + 1]
        seen.setdefault((t["group"], cut / len(scores)), []).append((prm.mean_score(scores[:cut]),
                                                                     prm.mean_score(other)))
    return any((a[0] - b[0]) * (a[1] - b[1]) < 0 for pairs in seen.values()
               for a, b in itertools.combinations(pairs, 2))


def _length_then_index_tie(c, ctx):
    """Failures tied on the best (κ, prefix mean), the longest of them first and two of the shortest after it."""
    tied = [i for i, km in enumerate(zip(c["kappas"], c["means"])) if km == max(zip(c["kappas"], c["means"]))]
    short = [i for i in tied if c["lengths"][i] == min(c["lengths"][j] for j in tied)]
    return len(short) >= 2 and c["lengths"][tied[0]] > c["lengths"][short[0]]


def _binding_cap(c, ctx):
    """Sampler log-probs under a cap other than 2 that binds on some policy tokens and not on others."""
    cap, b = c["kw"].get("tis_cap", 0.0), c["batch"]
    if not cap or cap == 2.0 or "sampler_logp" not in b:
        return False
    w = (b.get("old_logp", b["sampler_logp"]) - b["sampler_logp"]).exp()[grpo.tis_tokens(b)]
    return bool((w > cap).any() and ((w < cap) & (w > 1)).any())


def _index_tiebreak(c, ctx):
    return c.get("tiebreak") == "index" and c["mode"] == "scope"


EDGES = {
    "a text past max_steps": ("split_steps", _past_max_steps),
    "single newlines and no blank line": ("split_steps", lambda c, ctx: "\n" in c["text"]
                                          and not prm._blank_line_ends(c["text"])),
    "short pieces that merge, past max_steps": ("split_steps", _short_pieces_past_max_steps),
    "a straddle of a multi-byte character": ("step_token_spans", _straddled_character),
    "a tokenizer that is not byte-level": ("step_token_spans", _not_byte_level),
    "steps that end with their split characters": (
        "step_token_spans", lambda c, ctx: "tokenizer" not in c and any(s != s.rstrip() for s in c["steps"][:-1])),
    "no steps": ("first_error", lambda c, ctx: c["scores"] == []),
    "every step scored, none below τ": ("first_error", lambda c, ctx: c["scores"] and all(
        s is not None and s >= c["tau"] for s in c["scores"])),
    "an unscored step before the first one below τ": ("first_error", lambda c, ctx: None in c["scores"] and any(
        s is not None and s < c["tau"] for s in c["scores"][c["scores"].index(None):])
        and prm.first_error(c["scores"], c["tau"]) is None),
    "a tie in κ and prefix mean that length, then index, breaks": ("first_error", _length_then_index_tie),
    "an unscored step and no step below τ": ("first_error", lambda c, ctx: None in c["scores"] and not any(
        s is not None and s < c["tau"] for s in c["scores"])),
    "a turn-end eos_id, finished": ("splice", _turn_end),
    "a turn-end eos_id spelled in the suffix": ("splice",
                                                lambda c, ctx: _spelled_turn_end(c, ctx) and not c["finished"]),
    "the tokenizer's EOS text under a turn-end eos_id": (
        "splice", lambda c, ctx: c["eos_id"] not in (None, ctx["tokenizer"].eos_token_id)
        and ctx["tokenizer"].eos_token in c["suffix_text"]),
    "eos_id None, finished": ("splice", lambda c, ctx: c["eos_id"] is None and c["finished"] and c["suffix_text"]),
    "a tie that the first wrong step ranks the other way": ("scope_step", lambda c, ctx: _tie_flipped(c, False)),
    "a tie that the whole response ranks the other way": ("scope_step", lambda c, ctx: _tie_flipped(c, True)),
    "prm None": ("scope_step", lambda c, ctx: c["scores"] is None),
    'tiebreak "index"': ("scope_step", _index_tiebreak),
    "float32 logits past ±100": ("logprob_entropy", lambda c, ctx: str(c["logits"].dtype) == "torch.float32"
                                 and float(c["logits"].abs().max()) > 100),
    "float64 logits that float32 rounds": ("logprob_entropy", lambda c, ctx: str(c["logits"].dtype) == "torch.float64"
                                           and float(c["logits"].min()) > 1e4 and float(c["logits"].std()) < 1),
    "float64 logits past ±709": ("logprob_entropy", lambda c, ctx: str(c["logits"].dtype) == "torch.float64"
                                 and float(c["logits"].abs().max()) > 709),
    "a clip ε other than 0.2": ("clipped_surrogate", lambda c, ctx: c["eps"] != 0.2),
    "a shaping γ other than 0.1": ("shaped_offpolicy", lambda c, ctx: c["gamma"] != 0.1 and bool(c["mask"].any())),
    "an empty token-mean batch": ("policy_loss", lambda c, ctx: c["kw"]["loss_agg"] == "token-mean"
                                  and not c["resp"].any()),
    "policy_loss: a clip ε other than 0.2": ("policy_loss", lambda c, ctx: c["kw"]["clip_eps"] not in (0.2,)),
    "policy_loss: a γ other than 0.1 on a refiner token": (
        "policy_loss", lambda c, ctx: c["kw"]["shaping_gamma"] != 0.1 and c["kw"]["offpolicy_credit"] == "shaped"
        and bool((c["off"] * c["resp"]).any())),
    "policy_loss: unit credit on a refiner token": (
        "policy_loss", lambda c, ctx: c["kw"]["offpolicy_credit"] == "unit" and bool((c["off"] * c["resp"]).any())),
    "update: a clip ε other than 0.2 with π_old": (
        "update", lambda c, ctx: c["kw"].get("clip_eps", 0.2) != 0.2 and "old_logp" in c["batch"]),
    "update: a γ other than 0.1 on a refiner token": (
        "update", lambda c, ctx: c["kw"].get("shaping_gamma", 0.1) != 0.1 and bool(c["batch"]["offpolicy_mask"].any())),
    "update: unit credit on a refiner token": (
        "update", lambda c, ctx: c["kw"].get("offpolicy_credit", "shaped") == "unit"
        and bool(c["batch"]["offpolicy_mask"].any())),
    "update: old_logp with sampler_logp": ("update", lambda c, ctx: {"old_logp", "sampler_logp"} <= set(c["batch"])),
    "update: a TIS cap other than 2 that binds on some tokens": ("update", _binding_cap),
}


# ---------------------------------------------------------------------------------------------------
# the wrong solutions: (problem, the edge class it misses, [(module, function, text in the reference,
# replacement)], the check of the problem's own that it fails)
# ---------------------------------------------------------------------------------------------------
def _edit(module, function, old, new):
    return (module, function, old, new)


TAIL = '        steps = steps[:max_steps - 1] + ["".join(steps[max_steps - 1:])]'
EOS_TEXT = '    eos_text = tokenizer.decode([eos_id]) if eos_id is not None else ""'
TIE_MEAN = "[mean_score(trajs[i].step_scores[:trajs[i].cut]) for i in idx],"
LOG_SOFTMAX = "    logprobs_all = F.log_softmax(logits, dim=-1)  # (n, T, V) log π(v | context)"
UPDATE_KW = "shaping_gamma=shaping_gamma, offpolicy_credit=offpolicy_credit,"
STEPS = "tests/test_steps.py::"
UNSCORED = "return unscored if unscored is not None else len(scores) - 1"
SETTINGS = C + "test_update_hands_policy_loss_its_settings_and_weighs_against_pi_old"
MUTANTS = {
    # problem 1
    "max_steps_cuts_the_tail_off": (
        "split_steps", "a text past max_steps",
        [_edit("prm", "split_steps", TAIL, "        steps = steps[:max_steps]")],
        STEPS + "test_max_steps_merges_the_tail_into_the_last_step"),
    "max_steps_keeps_one_step_too_many": (
        "split_steps", "a text past max_steps",
        [_edit("prm", "split_steps", TAIL, '        steps = steps[:max_steps] + ["".join(steps[max_steps:])]')],
        STEPS + "test_max_steps_merges_the_tail_into_the_last_step"),
    "max_steps_caps_the_pieces_before_they_merge": (
        "split_steps", "short pieces that merge, past max_steps",
        [_edit("prm", "split_steps", "    pieces = _cut_after(text, seps)\n",
               "    pieces = _cut_after(text, seps)\n    if len(pieces) > max_steps:\n"
               '        pieces = pieces[:max_steps - 1] + ["".join(pieces[max_steps - 1:])]\n'),
         _edit("prm", "split_steps", "    if len(steps) > max_steps:\n" + TAIL + "\n", "")],
        STEPS + "test_max_steps_merges_the_tail_into_the_last_step"),
    "no_single_newline_fallback": (
        "split_steps", "single newlines and no blank line",
        [_edit("prm", "split_steps",
               '    if not seps:\n        seps = [i + 1 for i, ch in enumerate(text) if ch == "\\n"]\n', "")],
        STEPS + "test_single_newlines_are_used_only_when_there_is_no_blank_line"),
    # problem 2
    "straddled_character_left_in_the_prefix": (
        "step_token_spans", "a straddle of a multi-byte character",
        [_edit("prm", "step_token_spans", "        while start > starts[-1] and pending[start - 1]:\n"
               "            start -= 1  # the token before ends inside a character that the straddling token finishes\n",
               "")],
        STEPS + "test_a_character_split_over_byte_tokens_is_never_cut"),
    "token_strings_read_as_text_unchecked": (
        "step_token_spans", "a tokenizer that is not byte-level",
        [_edit("prm", "_char_reach", '        if "".join(chunks) == text:\n            return last, pending',
               "        return last, pending")],
        STEPS + "test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path"),
    "boundary_without_the_split_characters": (
        "step_token_spans", "steps that end with their split characters",
        [_edit("prm", "step_token_spans", "boundary += len(step)", "boundary += len(step.rstrip())")],
        STEPS + "test_spans_of_real_encodings_with_eos"),
    # problem 3
    "keep_ratio_of_no_steps_divides_by_zero": (
        "first_error", "no steps",
        [_edit("prm", "keep_ratio", "return cut / n_steps if n_steps > 0 else 0.0", "return cut / n_steps")],
        "tests/test_prm.py::test_keep_ratio"),
    "cut_point_of_an_error_free_list_keeps_every_step": (
        "first_error", "every step scored, none below τ",
        [_edit("prm", "cut_point", UNSCORED, "return unscored if unscored is not None else len(scores)")],
        "tests/test_prm.py::test_cut_point"),
    "first_error_reads_past_an_unscored_step": (
        "first_error", "an unscored step before the first one below τ",
        [_edit("prm", "first_error", "        if s is None:\n            return None",
               "        if s is None:\n            continue")],
        "tests/test_prm.py::test_first_error"),
    "cut_point_ignores_an_unscored_step": (
        "first_error", "an unscored step and no step below τ",
        [_edit("prm", "cut_point", UNSCORED, "return len(scores) - 1")],
        "tests/test_prm.py::test_cut_point"),
    "the_longer_failure_picked_on_a_tie": (
        "first_error", "a tie in κ and prefix mean that length, then index, breaks",
        [_edit("prm", "select_candidate", "lengths[i], i))", "-lengths[i], i))")],
        "tests/test_prm.py::test_select_candidate"),
    "the_later_failure_picked_on_a_tie": (
        "first_error", "a tie in κ and prefix mean that length, then index, breaks",
        [_edit("prm", "select_candidate", "lengths[i], i))", "lengths[i], -i))")],
        "tests/test_prm.py::test_select_candidate"),
    # problem 4
    "the_tokenizers_eos_appended_not_eos_id": (
        "splice", "a turn-end eos_id, finished",
        [_edit("refine", "splice", "        suffix_ids = suffix_ids + [eos_id]",
               "        suffix_ids = suffix_ids + [tokenizer.eos_token_id]")],
        C + "test_splice_ends_with_the_end_id_it_is_given"),
    "the_tokenizers_eos_text_ends_the_suffix": (
        "splice", "the tokenizer's EOS text under a turn-end eos_id",
        [_edit("refine", "splice", EOS_TEXT, '    eos_text = tokenizer.eos_token if eos_id is not None else ""')],
        C + "test_splice_ends_with_the_end_id_it_is_given"),
    "eos_id_none_appended": (
        "splice", "eos_id None, finished",
        [_edit("refine", "splice", "    if finished and len(suffix_ids) < budget and eos_id is not None:",
               "    if finished and len(suffix_ids) < budget:")],
        C + "test_splice_without_an_end_id_adds_and_cuts_nothing"),
    "eos_id_none_decoded": (
        "splice", "eos_id None, finished",
        [_edit("refine", "splice", EOS_TEXT, "    eos_text = tokenizer.decode([eos_id])")],
        C + "test_splice_without_an_end_id_adds_and_cuts_nothing"),
    "the_empty_end_text_ends_every_suffix": (
        "splice", "eos_id None, finished",
        [_edit("refine", "splice", "    if eos_text and eos_text in suffix_text:", "    if eos_text in suffix_text:")],
        C + "test_splice_without_an_end_id_adds_and_cuts_nothing"),
    # problem 6
    "tie_break_counts_the_first_wrong_step": (
        "scope_step", "a tie that the first wrong step ranks the other way",
        [_edit("prm", "select_failures", TIE_MEAN,
               "[mean_score(trajs[i].step_scores[:trajs[i].cut + 1]) for i in idx],")],
        problems.TIE_ON_THE_PREFIX),
    "tie_break_on_the_whole_response": (
        "scope_step", "a tie that the whole response ranks the other way",
        [_edit("prm", "select_failures", TIE_MEAN, "[mean_score(trajs[i].step_scores) for i in idx],")],
        problems.TIE_ON_THE_PREFIX),
    "tiebreak_not_passed_on": (
        "scope_step", 'tiebreak "index"',
        [_edit("prm", "select_failures", "[len(trajs[i].response_ids) for i in idx], tiebreak=tiebreak)",
               "[len(trajs[i].response_ids) for i in idx])")],
        problems.TIE_BY_INDEX),
    "no_prm_scored_all_the_same": (
        "scope_step", "prm None",
        [_edit("prm", "locate_first_errors", " or not t.correct] if prm else []", " or not t.correct]")],
        problems.NO_PRM),
    # problem 8
    "softmax_then_log": (
        "logprob_entropy", "float32 logits past ±100",
        [_edit("grpo", "logprobs_and_entropy", LOG_SOFTMAX,
               "    logprobs_all = torch.log(torch.softmax(logits, dim=-1))")],
        C + "test_logprobs_and_entropy_of_logits_past_100"),
    "exp_before_the_normalising_sum": (
        "logprob_entropy", "float32 logits past ±100",
        [_edit("grpo", "logprobs_and_entropy", LOG_SOFTMAX,
               "    logprobs_all = logits - logits.exp().sum(dim=-1, keepdim=True).log()")],
        C + "test_logprobs_and_entropy_of_logits_past_100"),
    "float64_log_probs_computed_in_float32": (
        "logprob_entropy", "float64 logits past ±709",
        [_edit("grpo", "logprobs_and_entropy", "if logits.dtype in (torch.float16, torch.bfloat16):",
               "if logits.dtype != torch.float32:")],
        "tests/test_grpo.py::test_logprobs_and_entropy_hand_computed"),
    "float64_log_probs_computed_in_float32_and_cast_back": (
        "logprob_entropy", "float64 logits that float32 rounds",
        [_edit("grpo", "logprobs_and_entropy", LOG_SOFTMAX,
               "    logprobs_all = F.log_softmax(logits.float(), dim=-1).to(logits.dtype)")],
        C + "test_float64_logits_keep_float64_precision"),
    # problem 9
    "clip_at_the_default_eps": (
        "clipped_surrogate", "a clip ε other than 0.2",
        [_edit("grpo", "clipped_surrogate", "torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)",
               "torch.clamp(ratio, 0.8, 1.2)")],
        "tests/test_grpo.py::test_clipped_surrogate_hand_computed"),
    # problem 10
    "shaping_at_the_default_gamma": (
        "shaped_offpolicy", "a shaping γ other than 0.1",
        [_edit("grpo", "shaped_offpolicy_loss", "prob / (prob + shaping_gamma)", "prob / (prob + 0.1)")],
        C + "test_shaped_offpolicy_loss_at_the_gamma_it_is_given"),
    # problem 11
    "token_mean_of_an_empty_batch_divides_by_zero": (
        "policy_loss", "an empty token-mean batch",
        [_edit("grpo", "loss_normaliser", "    return max(float(response_mask.bool().sum()), 1.0)",
               "    return float(response_mask.bool().sum())")],
        "tests/test_grpo.py::test_loss_normaliser_hand_computed"),
    "policy_loss_clips_at_the_default_eps": (
        "policy_loss", "policy_loss: a clip ε other than 0.2",
        [_edit("grpo", "policy_loss", "clipped_surrogate(logp, old_logp, advantages, on, clip_eps)",
               "clipped_surrogate(logp, old_logp, advantages, on, 0.2)")],
        C + "test_policy_loss_uses_the_clip_and_the_shaping_it_is_given"),
    "policy_loss_shapes_at_the_default_gamma": (
        "policy_loss", "policy_loss: a γ other than 0.1 on a refiner token",
        [_edit("grpo", "policy_loss", "shaped_offpolicy_loss(logp, advantages, off, shaping_gamma)",
               "shaped_offpolicy_loss(logp, advantages, off, 0.1)")],
        C + "test_policy_loss_uses_the_clip_and_the_shaping_it_is_given"),
    "unit_credit_ignored": (
        "policy_loss", "policy_loss: unit credit on a refiner token",
        [_edit("grpo", "policy_loss", '    if offpolicy_credit == "shaped":', "    if True:")],
        "tests/test_study_flags.py::test_unit_credit_hand_numbers"),
    # problem 12
    "update_clips_at_the_default_eps": (
        "update", "update: a clip ε other than 0.2 with π_old",
        [_edit("grpo", "update", "z=step.z, clip_eps=clip_eps, kl_coef=kl_coef,", "z=step.z, kl_coef=kl_coef,")],
        SETTINGS),
    "update_shapes_at_the_default_gamma": (
        "update", "update: a γ other than 0.1 on a refiner token",
        [_edit("grpo", "update", UPDATE_KW, "offpolicy_credit=offpolicy_credit,")], SETTINGS),
    "update_drops_the_credit": (
        "update", "update: unit credit on a refiner token",
        [_edit("grpo", "update", UPDATE_KW, "shaping_gamma=shaping_gamma,")], SETTINGS),
    "tis_weight_against_this_forward": (
        "update", "update: old_logp with sampler_logp",
        [_edit("grpo", "update", "truncated_is_weight(old_logp, part, tis_cap)",
               "truncated_is_weight(logp.detach(), part, tis_cap)")], SETTINGS),
    "tis_cap_not_passed_on": (
        "update", "update: a TIS cap other than 2 that binds on some tokens",
        [_edit("grpo", "update", "truncated_is_weight(old_logp, part, tis_cap)", "truncated_is_weight(old_logp, part, 2.0)")],
        SETTINGS),
    "update_ignores_the_batchs_old_logp": (
        "update", "update: a clip ε other than 0.2 with π_old",
        [_edit("grpo", "update", 'old_logp = part.get("old_logp", logp.detach())', "old_logp = logp.detach()")],
        SETTINGS),
}


@contextlib.contextmanager
def mutant(name):
    """The reference with mutant `name` in place of the functions it edits, in this process, until the block ends."""
    edits = {}
    for module, function, old, new in MUTANTS[name][2]:
        edits.setdefault((module, function), []).append((old, new))
    with pytest.MonkeyPatch.context() as mp:
        for (module, function), pairs in edits.items():
            mod = importlib.import_module(module)
            original = getattr(mod, function)
            src = textwrap.dedent(inspect.getsource(original))
            for old, new in pairs:
                assert src.count(old) == 1, f"{name}: {function} changed; update MUTANTS"
                src = src.replace(old, new)
            made = {}
            exec(compile(src, mod.__file__, "exec"), mod.__dict__, made)   # this file's own mutant text
            for m in list(sys.modules.values()):
                mine = (getattr(m, "__file__", None) or "").startswith(ROOT)
                if mine and getattr(m, "__dict__", {}).get(function) is original:
                    mp.setattr(m, function, made[function])
        yield


def _draw(seed):
    rng = random.Random(seed)
    ctx = {"tokenizer": fixtures.wrap_tokenizer(fixtures.held_out_tokenizer(rng)), "own_grpo": grpo}
    return ctx, {name: make(random.Random(f"{seed}-{name}"), ctx) for name, (make, _) in fixtures.PROBLEMS.items()}


@pytest.fixture(scope="module")
def drawn():
    """{seed: (ctx, {problem: cases})} for seeds 1–20, as write_fixtures draws them."""
    return {seed: _draw(seed) for seed in SEEDS}


@pytest.fixture(scope="module")
def graded(drawn):
    """want(seed, problem, i): the reference's output on case i of `problem` at `seed` (computed once, when asked)."""
    cache = {}

    def want(seed, problem, i):
        if (seed, problem, i) not in cache:
            ctx, cases = drawn[seed]
            cache[seed, problem, i] = fixtures.PROBLEMS[problem][1](MODS, ctx, cases[problem][i])
        return cache[seed, problem, i]
    return want


def test_each_edge_class_is_in_every_fixture_set(drawn):
    missing = [(edge, seed) for edge, (problem, holds) in EDGES.items() for seed, (ctx, cases) in drawn.items()
               if not any(holds(c, ctx) for c in cases[problem])]
    assert not missing, f"edge classes missing from the cases (edge, seed): {missing}"


def _fails(run, ctx, case, want) -> bool:
    try:
        return not fixtures.matches(run(MODS, ctx, case), want)
    except Exception:   # the grader counts a case that raises as wrong
        return True


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_edge_mutant_loses_its_problems_points_at_every_seed(name, drawn, graded):
    """Some case of the problem fails at every seed (so the problem scores 0 there); the cases of the edge class
    the mutant misses are tried first."""
    problem, edge = MUTANTS[name][:2]
    assert EDGES[edge][0] == problem
    run, holds = fixtures.PROBLEMS[problem][1], EDGES[edge][1]
    kept = []
    for seed, (ctx, cases) in drawn.items():
        order = sorted(range(len(cases[problem])), key=lambda i: not holds(cases[problem][i], ctx))
        for i in order:
            want = graded(seed, problem, i)   # the reference's, computed before the mutant is in place
            with mutant(name):
                if _fails(run, ctx, cases[problem][i], want):
                    break
        else:
            kept.append(seed)
    assert not kept, f"{name} keeps all of {problem}'s points at seeds {kept}"
    ctx, cases = drawn[SEEDS[0]]   # and it is a plausible solution, right away from its edge: not broken outright
    wants = [graded(SEEDS[0], problem, i) for i in range(len(cases[problem]))]
    with mutant(name):
        assert not all(_fails(run, ctx, c, want) for c, want in zip(cases[problem], wants)), \
            f"{name} fails every case of {problem} at seed {SEEDS[0]}: a broken mutant, not a plausible mistake"


def _own_check_fails(node, request, tmp_path_factory) -> bool:
    """Whether the test `node` (any of its parametrisations) fails, run here with its fixtures from `request`."""
    path, func = node.split("::")
    fn = getattr(importlib.import_module(os.path.basename(path)[:-3]), func)
    grids = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            names = mark.args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    for combo in itertools.product(*grids):
        with pytest.MonkeyPatch.context() as mp:
            params = {k: v for part in combo for k, v in part.items()}
            for arg in inspect.signature(fn).parameters:
                if arg not in params:
                    params[arg] = (mp if arg == "monkeypatch" else tmp_path_factory.mktemp("own") if arg == "tmp_path"
                                   else request.getfixturevalue(arg))
            try:
                fn(**params)
            except Exception:
                return True
    return False


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_edge_mutant_fails_its_problems_own_check(name, request, tmp_path_factory):
    problem, _, _, own = MUTANTS[name]
    assert own in problems.BY_NAME[problem].tests, f"{own} is not one of {problem}'s own checks"
    assert not _own_check_fails(own, request, tmp_path_factory), f"{own} fails on the reference"
    with mutant(name):
        assert _own_check_fails(own, request, tmp_path_factory), f"{own} passes with {name}"
