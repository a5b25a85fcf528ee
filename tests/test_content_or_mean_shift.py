"""Tests of the follow-up study (tools/studies/content_or_mean_shift.py): its plan and commands, the same-dose re-crediting, the
gradient-split masks, its statistics, and that its scope.py hooks change nothing they should not."""
import json
import os

import pytest
import torch

from harness.data import toy
from tools.studies import content_or_mean_shift as b2
from tools.studies import where_it_helps as ex
from tools.studies import common as studies


def args_():
    a = ex.parse_args([])
    a.stage, a.eval_n_cool, a.train_eval_size = b2.STAGE, 0, a.regime_eval_size
    return a


def test_plan_is_the_preregistered_order_and_commands():
    args = args_()
    jobs = b2.plan(args)
    assert jobs[0]["kind"] == "mechanism"
    runs = jobs[1:]
    assert len(runs) == 5 + 3 * 8
    head = [(j["row"], j["seed"]) for j in runs[:8]]
    assert head == [(b2.DOSE, 0), (b2.GRPO, 5), (b2.KEEP, 5), (b2.PHANTOM, 5),
                    (b2.DOSE, 1), (b2.GRPO, 6), (b2.KEEP, 6), (b2.PHANTOM, 6)]
    assert [(j["row"], j["seed"]) for j in runs[-3:]] == [(b2.GRPO, 12), (b2.KEEP, 12), (b2.PHANTOM, 12)]
    cmd = {(j["row"], j["seed"]): b2.command(j, args) for j in runs}
    grpo = cmd[(b2.GRPO, 5)]
    assert grpo[1] == "scope.py" and "--mode" in grpo and grpo[grpo.index("--seed") + 1] == "5"
    assert "lateness" not in " ".join(grpo) and any("toy_warm" in x for x in grpo)   # the weak start's cache
    keep = cmd[(b2.KEEP, 5)]
    assert keep[1:4] == ["-m", "tools.studies.content_or_mean_shift", "--scope-run"] and "--keep-checkpoints" in keep
    assert keep[-2:] == ["--save-every", "25"]            # the last --save-every wins
    dose = cmd[(b2.DOSE, 0)]
    assert "--same-dose" in dose and dose[dose.index("--toy-refiner-style") + 1] == "1"
    assert "--repair-advantage" in cmd[(b2.PHANTOM, 5)]
    # the same eval settings and row names as the recorded seeds 0-4 they pair with
    assert runs[2]["name"] == "study-regime-weak-ladder-scope-paper--any-replace-s5"


def _repair(tok, prefix_text, suffix_text, question):
    from refine import Trajectory

    p, s = tok.encode(prefix_text, add_special_tokens=False), tok.encode(suffix_text, add_special_tokens=False)
    return Trajectory(question=question, answer="0", group=0, prompt_ids=[1], response_ids=p + s,
                      text=prefix_text + suffix_text, reward=1.0, correct=True, offpolicy_mask=[0] * len(p) + [1] * len(s),
                      source="rectified", prefix_len=len(p))


def test_same_dose_credits_the_whole_repair_to_the_refiner():
    from harness.engines.generate import load_causal_lm

    _, tok = load_causal_lm(toy.cache_path("cache"), "cpu")
    problem = toy.make_problems(1, seed=3, min_ops=3, max_ops=3)[0]
    start, ops = toy.parse_question(problem["question"])
    own = toy._chain_steps(start, ops, style=0)
    foreign = toy._chain_steps(start, ops, style=1)
    prefix = toy.STEP_SEP.join(own[:2]) + toy.STEP_SEP
    suffix = toy.STEP_SEP.join(foreign[2:])
    t = _repair(tok, prefix, suffix, problem["question"])
    new, equal = b2.same_dose_credit(t, tok)
    assert equal and new.response_ids == t.response_ids
    assert new.offpolicy_mask == [1] * len(t.response_ids) and new.source == "replaced"
    # a correct prefix in another text is rebuilt from the oracle's style-0 steps; the suffix is kept
    other = toy.STEP_SEP.join(foreign[:2]) + toy.STEP_SEP
    t2 = _repair(tok, other, suffix, problem["question"])
    new2, equal2 = b2.same_dose_credit(t2, tok)
    assert not equal2 and new2.text == prefix + suffix and sum(new2.offpolicy_mask) == len(new2.response_ids)


def test_same_dose_wrapper_leaves_policy_rows_and_replacements_alone():
    from harness.engines.generate import load_causal_lm
    from refine import Trajectory

    _, tok = load_causal_lm(toy.cache_path("cache"), "cpu")
    problem = toy.make_problems(1, seed=3, min_ops=3, max_ops=3)[0]
    own = toy._chain_steps(*toy.parse_question(problem["question"]), style=0)
    rep = _repair(tok, toy.STEP_SEP.join(own[:1]) + toy.STEP_SEP, toy.STEP_SEP.join(own[1:]), problem["question"])
    pol = Trajectory(question=problem["question"], answer="0", group=0, prompt_ids=[1], response_ids=[5, 6], text="ab")
    trace = {"accepted": True, "mode": "scope"}
    counts = {"repairs": 0, "prefix_equal": 0}
    merged, traces = b2.with_same_dose(lambda *a, **k: ([pol, rep], [trace]), counts)(None, None, None, tok)
    assert merged[0] is pol and merged[1].source == "replaced" and traces[0]["mode"] == "replace"
    assert counts == {"repairs": 1, "prefix_equal": 1}


def test_part_masks_partition_the_response_tokens():
    from refine import Trajectory

    mk = lambda g, src, n, off=0: Trajectory(question="q", answer="a", group=g, prompt_ids=[1], response_ids=[2] * n,  # noqa: E731
                                             text="x", source=src, offpolicy_mask=[0] * (n - off) + [1] * off)
    trajs = [mk(0, "policy", 3), mk(0, "rectified", 4, off=2), mk(1, "policy", 2), mk(1, "policy", 3),
             mk(2, "policy", 2)]   # group 0 all-fail with a repair; group 1 mixed; group 2 all-fail, no repair
    from grpo import build_batch
    batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                        [t.offpolicy_mask for t in trajs], torch.zeros(5), 0)
    m = b2.part_masks(batch, trajs, all_fail_before={0, 2})
    total = sum(x.long() for x in m.values())
    assert torch.equal(total, batch["response_mask"])          # a partition
    assert m["F"].sum() == 3 and m["K"].sum() == 2 and m["S"].sum() == 2 and m["M"].sum() == 2 + 3 + 2


def test_statistics_by_hand():
    c = b2.t_interval([0.01, -0.01, 0.03])
    # mean 0.01, sd 0.02, t(0.975, 2) = 4.303: half-width 4.303 * 0.02 / sqrt(3)
    assert c["mean"] == pytest.approx(0.01) and c["hi"] - c["mean"] == pytest.approx(4.3027 * 0.02 / 3 ** 0.5, rel=1e-3)
    assert b2.verdict({"lo": -0.01, "hi": 0.015, "n": 13}, 13) == "≈ 0"
    assert b2.verdict({"lo": -0.01, "hi": 0.015, "n": 8}, 13).startswith("partial")
    assert b2.verdict({"lo": -0.05, "hi": -0.001, "n": 5}, 5) == "< 0"
    assert b2.verdict({"lo": -0.03, "hi": 0.01, "n": 5}, 5) == "cannot tell"
    r = b2.sd_ratio([0.0, 2.0], [0.0, 1.0])
    assert r["ratio"] == pytest.approx(2.0) and r["lo"] < 2.0 < r["hi"]


def _metrics(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time_")} for line in f]


def test_the_hooks_change_nothing_but_what_they_name(tmp_path):
    """A 2-step toy run through scope_run --keep-checkpoints trains exactly as scope.py (same metrics), and keeps
    each checkpoint; --same-dose re-credits its repairs and counts them; the hooks are gone afterwards."""
    import scope
    from harness.run import wiring

    rectify, checkpoint = scope.rectify, wiring.Run.checkpoint
    common = ["--toy", "--steps", "2", "--eval-every", "0", "--save-every", "1"]
    plain, kept, dose = (str(tmp_path / n) for n in ("plain", "kept", "dose"))
    scope.main(scope.parse_args([*common, "--run-name", plain]))
    b2.scope_run([*common, "--run-name", kept, "--keep-checkpoints"])
    assert _metrics(plain) == _metrics(kept)
    assert sorted(os.listdir(os.path.join(kept, "checkpoints"))) == ["step-1", "step-2"]
    b2.scope_run([*common, "--run-name", dose, "--same-dose", "--toy-refiner-style", "1"])
    counts = json.load(open(os.path.join(dose, "same_dose.json")))
    traces = [json.loads(line) for line in open(os.path.join(dose, "traces.jsonl"))]
    accepted = [t for t in traces if t["accepted"]]
    assert counts["repairs"] == sum(t.get("same_dose", False) for t in accepted) > 0
    assert all(t["mode"] == "replace" for t in accepted)
    assert (scope.rectify, wiring.Run.checkpoint) == (rectify, checkpoint)


def test_repair_token_probs_teacher_forces_prefix_and_suffix_one_token_at_a_time(char_tokenizer, tiny_causal_lm):
    """The π that tracking (T) and the mechanism record read: for each kept-prefix and suffix token, the softmax of
    the logits one position earlier, here recomputed token by token; the corrected token is the first suffix
    character that differs from the failed text after the prefix (here 'x' at index 2)."""
    from harness.data.prompt import format_prompt

    model = tiny_causal_lm(char_tokenizer)
    trace = {"question": "1+2?", "prefix_text": "a=1", "steps": ["a=1", "b=23"], "suffixes": ["zz", "b=x3"],
             "attempt_correct": [False, True]}
    pi, kept, corrected = studies.repair_token_probs(model, char_tokenizer, trace)
    head = format_prompt(char_tokenizer, "1+2?")
    ids = head + char_tokenizer.encode("a=1b=x3", add_special_tokens=False)
    expected = []
    for k in range(len(head), len(ids)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:k]])).logits[0, -1]
        expected.append(torch.softmax(logits.float(), -1)[ids[k]].item())
    assert kept == 3 and corrected == 2 and len(pi) == 7
    assert pi == pytest.approx(expected, rel=1e-5, abs=1e-7)
