"""Tests of the study's switches: --rectify-groups, --offpolicy-credit, the toy model refiner, and the study's
statistics. The scope.py runs are in-process toy runs of 2-3 steps on the shipped warm start (cache/)."""
import json
import math
import os
import random

import numpy as np
import pytest
import torch

import grpo
from harness.data import toy


# ---------------------------------------------------------------- unit credit on refiner tokens, by hand

def test_unit_credit_hand_numbers():
    """One sequence, 3 response tokens: token 0 the policy's, tokens 1-2 the refiner's (π = 0.77, 0.97).
    A = 0.5, Z = N · max_new_tokens = 1 · 4. unit: ℓ = −A·log π, dℓ/dlogp = −A; shaped: ℓ = −A·π/(π+γ)."""
    pi = torch.tensor([[0.6, 0.77, 0.97]])
    logp = pi.log().clone().requires_grad_(True)
    kw = dict(old_logp=pi.log(), advantages=torch.tensor([0.5]), response_mask=torch.ones(1, 3),
              offpolicy_mask=torch.tensor([[0.0, 1.0, 1.0]]), loss_agg="constant", max_new_tokens=4)
    loss, _ = grpo.policy_loss(logp, **kw, offpolicy_credit="unit")
    # on-policy token: ratio 1 -> −A; refiner tokens: −A·log π
    want = (-0.5 - 0.5 * math.log(0.77) - 0.5 * math.log(0.97)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.125, -0.125, -0.125], rel=1e-6)

    logp2 = pi.log().clone().requires_grad_(True)
    loss2, _ = grpo.policy_loss(logp2, **kw, shaping_gamma=0.1)   # default: shaped
    want2 = (-0.5 - 0.5 * 0.77 / 0.87 - 0.5 * 0.97 / 1.07) / 4
    assert loss2.item() == pytest.approx(want2, rel=1e-6)
    loss2.backward()
    # the corrected token at π = 0.77 gets γπ/(π+γ)² ≈ 0.102 of the unit gradient
    assert logp2.grad[0, 1].item() == pytest.approx(-0.5 * 0.1 * 0.77 / 0.87 ** 2 / 4, rel=1e-5)
    assert logp2.grad[0, 1].item() / logp.grad[0, 1].item() == pytest.approx(0.1017, abs=1e-3)


def test_unit_credit_rejects_unknown_value():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="offpolicy_credit"):
        grpo.policy_loss(z, z, torch.zeros(1), torch.ones(1, 2), torch.ones(1, 2), max_new_tokens=2,
                         offpolicy_credit="units")


# ---------------------------------------------------------------- toy world pieces

def test_slip_probability_and_uniform_positions():
    assert toy.slip_probability(1, 0.3) == pytest.approx(0.3)
    assert toy.slip_probability(6, 0.3) == pytest.approx(1 - 0.7 ** 6)
    rng = random.Random(0)
    draws = [toy.draw_error_at(4, rng, lateness=0.0, boxed=False) for _ in range(8000)]
    assert set(draws) == {0, 1, 2, 3}                           # never the answer copy (index 4)
    assert all(abs(draws.count(k) / 8000 - 0.25) < 0.03 for k in range(4))
    with pytest.raises(ValueError, match="no step"):
        toy.draw_error_at(0, rng, lateness=0.0, boxed=False)


def test_ladder_covers_one_to_six_operations():
    ops = {len(toy.parse_question(p["question"])[1]) for p in toy.make_problems(300, seed=0)}
    assert ops == set(range(toy.TASK_DEFAULTS["min_ops"], toy.TASK_DEFAULTS["max_ops"] + 1)) == set(range(1, 7))


def test_refiner_cache_is_apart_from_the_warm_start(tmp_path):
    assert toy.refiner_path(str(tmp_path)) != toy.cache_path(str(tmp_path))
    assert toy.refiner_path(str(tmp_path), refiner_steps=5) != toy.refiner_path(str(tmp_path))
    with pytest.raises(TypeError, match="refiner_stpes"):
        toy.refiner_path(str(tmp_path), refiner_stpes=5)


# ---------------------------------------------------------------- scope.py in the toy world

def run_toy(tmp_path, *flags, steps=3):
    import scope

    name = str(tmp_path / "run")
    args = scope.parse_args(["--toy", "--steps", str(steps), "--eval-every", "0", "--run-name", name, *flags])
    scope.main(args)
    with open(os.path.join(name, "traces.jsonl")) as f:
        traces = [json.loads(line) for line in f]
    with open(os.path.join(name, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return traces, metrics


def test_all_fail_only_never_rectifies_a_group_with_a_success(tmp_path):
    traces, metrics = run_toy(tmp_path, "--rectify-groups", "all-fail")
    assert traces, "no all-fail group in 3 steps: the toy regime lost its all-fail groups"
    for tr in traces:
        assert tr["group_all_fail"] and tr["group_rewards"] and max(tr["group_rewards"]) == 0.0, tr
    assert sum(m["rectify_all_fail"] for m in metrics) == sum(m["rectify_accepted"] for m in metrics)


def test_any_rectifies_mixed_groups_and_records_group_rewards(tmp_path):
    traces, metrics = run_toy(tmp_path, "--rectify-groups", "any", steps=2)
    mixed = [tr for tr in traces if not tr["group_all_fail"]]
    assert mixed and all(max(tr["group_rewards"]) == 1.0 for tr in mixed)
    assert all(len(tr["group_rewards"]) == 8 for tr in traces)   # the group before repair (G = 8)


def test_model_refiner_goes_through_refiner_and_splice(tmp_path, monkeypatch):
    import refine
    import scope
    from harness.engines.refiner import Refiner

    calls = {"continue_from": 0, "splice": 0, "credit": []}
    real_continue, real_splice, real_update = Refiner.continue_from, refine.splice, scope.update

    def continue_from(self, *a, **k):
        calls["continue_from"] += 1
        return real_continue(self, *a, **k)

    def splice(*a, **k):
        calls["splice"] += 1
        return real_splice(*a, **k)

    def update(*a, **k):
        calls["credit"].append(k["offpolicy_credit"])
        return real_update(*a, **k)

    monkeypatch.setattr(Refiner, "continue_from", continue_from)
    monkeypatch.setattr(refine, "splice", splice)
    monkeypatch.setattr(scope, "update", update)
    traces, metrics = run_toy(tmp_path, "--refiner", "toy-model", "--offpolicy-credit", "unit", steps=2)
    assert calls["continue_from"] == sum(1 for m in metrics if m["rectify_tried"]) > 0
    assert calls["splice"] == 2 * len(traces)                       # --refine-attempts 2 candidates each
    assert calls["credit"] == ["unit", "unit"]
    accepted = [tr for tr in traces if tr["accepted"]]
    assert accepted, "the model refiner repaired nothing in 2 steps"
    for tr in accepted:   # the kept prefix is the policy's own text, the suffix the refiner's
        assert tr["prefix_text"] + tr["suffixes"][tr["attempt_correct"].index(True)]
        assert tr["reward_after"] == 1.0


def test_unknown_toy_refiner_is_refused(tmp_path, capsys):
    """The pre-flight refuses it in one line (exit code 2) naming the valid toy refiners."""
    with pytest.raises(SystemExit) as exc:
        run_toy(tmp_path, "--refiner", "toy-big", steps=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--refiner 'toy-big'" in err and "toy-oracle" in err


# ---------------------------------------------------------------- the study's statistics

def test_ci95_hand_numbers():
    from tools.studies.common import ci95

    c = ci95([0.01, 0.03, 0.02])           # mean 0.02, sd 0.01, t_{0.975,2} = 4.3027
    assert c["mean"] == pytest.approx(0.02)
    assert c["hi"] - c["mean"] == pytest.approx(4.3027 * 0.01 / math.sqrt(3), abs=1e-6)
    assert ci95([0.5])["lo"] is None and ci95([])["n"] == 0


def test_paired_difference_matches_seeds():
    from tools.studies.common import paired

    def run(row, seed, acc):
        return {"row": row, "seed": seed, "group": "main", "steps": 5, "eval": {"acc_t1": acc}, "train": {}}

    results = [run("grpo", 0, 0.5), run("grpo", 1, 0.6), run("x", 1, 0.7), run("x", 0, 0.4)]
    d = paired(results, "main", ["acc_t1"])["x"]["acc_t1"]
    assert d["n"] == 2 and d["mean"] == pytest.approx((-0.1 + 0.1) / 2)


def test_study_plan_has_every_row():
    """Stage 1: 7 grid rows x seeds (+ 2 warm-start evals); stage 2 from the ranking: best + unit credit /
    model refiner / PRM noise 0.2, long runs of grpo and best (4x steps, long seeds), weak start rows."""
    from tools.studies.where_it_helps import parse_args, plan_grid, plan_stage2
    from tools.studies.common import GRID, scope_command

    args = parse_args(["--seeds", "0,1,2,3,4", "--steps", "40"])
    grid = plan_grid(args)
    assert len(grid) == 2 + 5 * len(GRID) and {j["row"] for j in grid} == set(GRID) | {"warm start"}
    stage2 = plan_stage2(args, ["scope all-fail/append", "scope any/replace"])
    rows = {(j["group"], j["row"]) for j in stage2}
    best = "scope all-fail/append"
    assert {("main", f"{best} + unit credit"), ("main", f"{best} + model refiner"), ("main", f"{best} + PRM noise 0.2"),
            ("long", "grpo"), ("long", f"best: {best}"), ("weak", "grpo"), ("weak", best)} == rows
    long = [j for j in stage2 if j["group"] == "long"]
    assert len(long) == 6 and all(j["steps"] == 160 for j in long) and {j["seed"] for j in long} == {0, 1, 2}
    runner_up = plan_stage2(parse_args(["--weak-runner-up"]), ["scope all-fail/append", "scope any/replace"])
    assert ("weak", "scope any/replace") in {(j["group"], j["row"]) for j in runner_up}
    unit = next(j for j in stage2 if j["row"].endswith("unit credit"))
    cmd = scope_command(unit, args)
    assert cmd[cmd.index("--offpolicy-credit") + 1] == "unit" and cmd[cmd.index("--rectify-groups") + 1] == "all-fail"
    weak = next(j for j in stage2 if j["group"] == "weak")
    assert "--dataset" in scope_command(weak, args)
    assert len({j["name"] for j in grid + stage2}) == len(grid + stage2)   # no two runs share a folder


def test_smoothing_keeps_the_measured_ends():
    """The curves start from the step-0 value every row shares: the window shrinks to one point at the ends."""
    from tools.studies.where_it_helps import smooth

    y = np.array([0.30, 0.40, 0.20, 0.60, 0.50])
    s = smooth(y, 3)
    assert s[0] == pytest.approx(0.30) and s[-1] == pytest.approx(0.50)
    assert s[1] == pytest.approx(0.30) and s[2] == pytest.approx(0.40)        # (0.3+0.4+0.2)/3, (0.4+0.2+0.6)/3
    assert smooth(y, 5)[1] == pytest.approx(0.30) and smooth(y, 5)[2] == pytest.approx(0.40)   # 5-wide only mid


def test_best_cell_is_chosen_on_training_reward_not_on_the_reported_eval():
    """Stage 2's 'best' comes from the policy's own training rollouts (last 5 steps), so the held-out eval that
    the tables report does not also pick the row (no selection bias on it)."""
    from tools.studies.where_it_helps import rank_cells

    def run(row, seed, acc, reward):
        return {"row": row, "seed": seed, "group": "main", "steps": 5, "eval": {"acc_t1": acc},
                "train": {"reward_last5": reward}}

    results = [run("scope any/replace", 0, 0.9, 0.2), run("scope any/append", 0, 0.1, 0.3),
               run("scope any/append", 1, 0.1, 0.5), run("scope any/replace", 1, 0.9, 0.2)]
    assert rank_cells(results)[:2] == ["scope any/append", "scope any/replace"]


def test_repair_credit_hand_numbers():
    """Group [0, 0, 1, 0] (G = 4), the picked 0 repaired to 1. replace: [1, 0, 1, 0], mean 0.5, A_repair = 0.5;
    append: [0, 0, 1, 0, 1], mean 0.4, A_repair = 0.6, A_fail = -0.4. Shaped weight at π = 0.77, γ = 0.1:
    0.1 * 0.77 / 0.87² = 0.101733...; unit: 1."""
    from tools.studies.common import repair_credit

    trace = {"group_rewards": [0.0, 0.0, 1.0, 0.0], "reward_before": 0.0, "reward_after": 1.0}
    r = repair_credit(trace, "replace", [0.77, 0.97], 0)
    assert r["a_repair"] == pytest.approx(0.5) and r["a_fail"] is None
    assert r["corrected_coef"] == pytest.approx(0.5 * 0.1 * 0.77 / 0.87 ** 2)
    assert r["refiner_coef"] == pytest.approx(0.5 * (0.1 * 0.77 / 0.87 ** 2 + 0.1 * 0.97 / 1.07 ** 2) / 2)
    a = repair_credit(trace, "append", [0.77], 0, credit="unit")
    assert a["a_repair"] == pytest.approx(0.6) and a["a_fail"] == pytest.approx(-0.4)
    assert a["corrected_coef"] == pytest.approx(0.6) and a["refiner_pi"] == pytest.approx(0.77)


def test_weak_start_policy_is_passed_to_the_weak_runs_only():
    """--weak-start names another toy warm start (an earlier SFT stop): the weak group's runs start from it
    (--model its cache folder), the main group's from the shipped one; a bad JSON stops at parsing."""
    from tools.studies.where_it_helps import parse_args, plan_grid, plan_stage2
    from tools.studies.common import ROOT, scope_command, start_path

    args = parse_args(["--weak-start", '{"sft_steps": 300}'])
    weak = next(j for j in plan_stage2(args, ["scope any/replace", "scope any/append"]) if j["group"] == "weak")
    main = next(j for j in plan_grid(args) if j["row"] == "grpo")
    cmd = scope_command(weak, args)
    assert cmd[cmd.index("--model") + 1] == os.path.relpath(start_path(weak, args), ROOT)
    assert start_path(weak, args) != start_path(main, args) and "--model" not in scope_command(main, args)
    assert "--model" not in scope_command(weak, parse_args(["--weak-start", "{}"]))
    with pytest.raises(SystemExit):
        parse_args(["--weak-start", "{sft_steps: 300}"])


def test_compare_studies_finds_every_differing_number():
    from tools.studies.where_it_helps import compare_studies

    def run(row, seed, acc, minutes):
        return {"group": "main", "row": row, "seed": seed, "steps": 20, "eval": {"acc_t1": acc},
                "train": {"frac_all_fail": 0.2, "minutes": minutes}}

    a = {"runs": [run("grpo", 0, 0.30, 1.0), run("grpo", 1, 0.31, 1.0), run("x", 0, 0.4, 1.0)]}
    b = {"runs": [run("grpo", 0, 0.30, 2.0), run("x", 0, 0.41, 1.0)]}
    matched, diffs = compare_studies(a, b)
    assert matched == 2 and diffs == ["main/x/s0: eval.acc_t1 0.4 != 0.41"]   # wall minutes may differ


# ---------------------------------------------------------------- the because stage's switches

def _traj(group, reward, source="policy"):
    from refine import Trajectory

    return Trajectory(question="q", answer="1", group=group, prompt_ids=[1], response_ids=[2, 3], text="t",
                      reward=reward, correct=reward == 1.0, source=source)


def test_a_phantom_repair_counts_in_its_group_mean_but_gets_advantage_zero():
    """Group 0 all-fail (8 × 0), one failure replaced by an accepted repair (reward 1): the group mean is 1/8.
    keep: A_repair = 7/8, A_fail = −1/8. zero: A_repair = 0, the 7 failures still −1/8 (the mean moved).
    Group 1 (rewards 1, 0, 0, 0, 0, 0, 0, 0, no repair) is untouched: 7/8 and −1/8."""
    from grpo import group_advantages
    from grpo import zero_repair_advantages

    def advantages(trajs):
        return group_advantages([t.reward for t in trajs], groups=[t.group for t in trajs])

    batch = [_traj(0, 0.0) for _ in range(7)] + [_traj(0, 1.0, "rectified")]
    batch += [_traj(1, 1.0)] + [_traj(1, 0.0) for _ in range(7)]
    keep = advantages(batch)
    assert keep[7].item() == pytest.approx(7 / 8) and keep[:7].tolist() == pytest.approx([-1 / 8] * 7)
    zero = zero_repair_advantages(batch, keep)
    assert zero[7].item() == 0.0 and zero[:7].tolist() == pytest.approx([-1 / 8] * 7)
    assert zero[8:].tolist() == pytest.approx([7 / 8] + [-1 / 8] * 7)
    assert len(zero) == len(batch) == 16          # N unchanged: the repair stays in the batch (and in Z)
    replaced = [_traj(0, 1.0, "replaced")] + [_traj(0, 0.0)] * 3   # whole replacement, a group of 4
    assert zero_repair_advantages(replaced, advantages(replaced)).tolist() \
        == pytest.approx([0.0, -0.25, -0.25, -0.25])


def test_the_index_tie_break_picks_by_position():
    """Three failures tied on κ = 0.5 and prefix mean 1.0, lengths 30, 10, 20 tokens: 'length' picks the
    shortest (index 1), 'index' the first (index 0); a larger κ still wins under both."""
    from prm import select_candidate

    k, m, lengths = [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [30, 10, 20]
    assert select_candidate(k, m, lengths) == 1 == select_candidate(k, m, lengths, tiebreak="length")
    assert select_candidate(k, m, lengths, tiebreak="index") == 0
    assert select_candidate([0.2, 0.5, 0.5], m, [5, 30, 10], tiebreak="index") == 1
    assert select_candidate([0.5, 0.5], [0.5, 1.0], [5, 30], tiebreak="index") == 1   # the prefix mean before index
    with pytest.raises(ValueError, match="tiebreak"):
        select_candidate(k, m, lengths, tiebreak="random")


def test_select_failures_passes_the_tie_break():
    """prm.select_failures on one group of three failures, all cut after 1 of 2 steps, lengths 30 / 10 / 20."""
    import scope
    from prm import select_failures
    from refine import Trajectory

    trajs = [Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=[2] * n, text="t")
             for n in (30, 10, 20)]
    for t in trajs:
        t.steps, t.step_scores, t.cut, t.keep_ratio, t.prefix_len = ["a", "b"], [1.0, 0.0], 1, 0.5, 3
    for tiebreak, pick in (("length", 1), ("index", 0)):
        args = scope.parse_args(["--toy", "--select-tiebreak", tiebreak])
        assert select_failures(trajs, range(1), args.mode, args.rectify_groups, args.select_tiebreak) == [(pick, 3)]


def test_new_switches_default_off_and_leave_the_commands_unchanged():
    """Every new flag defaults to today's behaviour, and the regime records (committed) are still found by
    their commands: a default command is byte-identical to the one recorded."""
    import scope
    from tools.studies import why_it_helps as because
    from tools.studies import where_it_helps as ex

    a = scope.parse_args(["--toy"])
    assert (a.toy_refiner_style, a.repair_advantage, a.select_tiebreak) == ("prefix", "keep", "length")
    if not os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")):
        pytest.skip("the study's records are not here: a course copy leaves results/ out")
    args = ex.parse_args(["--stage", "because"])
    args.eval_n_cool, args.train_eval_size = 0, args.regime_eval_size
    assert len(because.read_references(args)) == 70        # the 60 map runs + the diversity stage's 10


@pytest.mark.slow
def test_phantom_foreign_and_index_runs_log_every_style(tmp_path):
    """Two toy steps with each switch: the foreign refiner's repairs are mixed texts whose suffix is style 1,
    every step logs the style shares of all the policy's own rollouts, and the phantom run trains."""
    traces, metrics = run_toy(tmp_path / "f", "--toy-refiner-style", "1", steps=2)
    accepted = [t for t in traces if t["accepted"]]
    assert accepted and all(toy.style_of(t["suffixes"][t["attempt_correct"].index(True)]) == 1 for t in accepted)
    assert all(len(m["style_share_all"]) == 3 and m["style_other_all"] is not None for m in metrics)
    _, metrics = run_toy(tmp_path / "p", "--repair-advantage", "zero", steps=2)
    assert all("style_share_all" in m and m["rectify_accepted"] > 0 for m in metrics)
    _, metrics = run_toy(tmp_path / "i", "--select-tiebreak", "index", steps=1)
    assert metrics[-1]["style_share_all"] == [1.0, 0.0, 0.0] or metrics[-1]["style_other_all"] > 0


LEAK_JOB = '''
import os, subprocess

def work(j, args):
    """One study job that never ends: a run (sleep) started the way studies.train starts scope.py."""
    with open(os.path.join(os.environ["LEAK_DIR"], f"worker{j['i']}"), "w") as f:
        f.write(str(os.getpid()))
    path = os.path.join(os.environ["LEAK_DIR"], f"run{j['i']}")
    subprocess.run(["sh", "-c", f"echo $$ > {path}.tmp && mv {path}.tmp {path} && exec sleep 120"])
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"   # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_stopping_a_study_stops_its_workers_and_their_runs(tmp_path, sig):
    """A study (tools.studies.run_all, 2 workers, jobs that never end) stopped by SIGTERM or Ctrl-C's SIGINT
    sent to its own process only (a study in the background): within seconds no worker and no run is left."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "leakjob.py").write_text(LEAK_JOB)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Ctrl-C's KeyboardInterrupt, as at a terminal, whatever SIGINT's disposition the test run inherited (a
    # shell starts a background job with SIGINT ignored, and Python then installs no KeyboardInterrupt)
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"import sys, time, argparse; sys.path[:0] = [{root!r}, {str(tmp_path)!r}]\n"
            "from tools.studies import common as studies\nimport leakjob\n"
            "studies.run_all([{'i': i} for i in range(4)], argparse.Namespace(jobs=2), time.time(),"
            " worker=leakjob.work)\n")
    study = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "LEAK_DIR": str(tmp_path)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("run[0-9]"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("worker*")) + sorted(tmp_path.glob("run[0-9]"))]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        study.send_signal(getattr(signal, sig))
        study.wait(timeout=60)
        deadline = time.time() + 30
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "a worker or its run outlived the study"
        assert not list(tmp_path.glob("run[2-3]"))       # the queued jobs never started
    finally:
        if study.poll() is None:
            study.kill()
        for p in tmp_path.glob("run[0-9]"):             # never leave a sleep behind, even when the test fails
            if _alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)
