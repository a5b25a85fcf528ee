"""The regime-map stage of the toy study (tools/studies/when_it_helps.py): its plan, its statistics by hand, its records."""
import json
import os

import numpy as np
import pytest

from tools.studies import where_it_helps as ex
from tools.studies import when_it_helps as regime
from tools.studies import common as studies


def _run(group, row, seed, *, reward, eval_acc, all_fail=None, acc=0.5, first3=0.5):
    n = len(reward)
    return {"group": group, "row": row, "seed": seed, "steps": n, "name": f"{group}-{row}-{seed}",
            "eval": {"acc_t1": acc},
            "train": {"frac_all_fail_first3": first3, "reward_last5": sum(reward[-5:]) / len(reward[-5:]),
                      "curve": {"step": [0, n], "eval_acc": eval_acc, "reward": reward,
                                "all_fail": all_fail or [0.5] * n}}}


def test_plan_is_seed_major_with_every_start_and_row():
    """Seed 0 of every (start, row) cell comes before any seed 1 (a stopped study still holds every cell);
    every run starts from its start's policy on its start's task, with the regime's steps and eval cadence."""
    args = ex.parse_args(["--stage", "regime", "--seeds", "0,1"])
    jobs = regime.plan_regime(args, ["main-ladder", "weak-ladder", "weak-6ops"])
    trained = [j for j in jobs if j["steps"]]
    assert len(trained) == 2 * 3 * 4 and [j["seed"] for j in trained] == [0] * 12 + [1] * 12
    assert {j["row"] for j in trained} == {"grpo", "scope (paper): any/replace", "best: scope any/append",
                                           "replace (whole)"}
    weak = next(j for j in trained if j["group"] == "regime-weak-6ops" and j["row"] == "grpo")
    cmd = studies.scope_command(weak, args)
    assert cmd[cmd.index("--steps") + 1] == "100" and cmd[cmd.index("--eval-every") + 1] == "25"
    assert "--dataset" in cmd and "--model" in cmd                       # 6-operation task, weaker SFT
    strong = next(j for j in trained if j["group"] == "regime-main-ladder")
    strong_cmd = studies.scope_command(strong, args)
    assert "--dataset" not in strong_cmd and "--model" not in strong_cmd
    middle = next(j for j in trained if j["group"] == "regime-weak-ladder")
    assert studies.start_path(middle, args) == studies.start_path(weak, args) != studies.start_path(strong, args)
    assert len({j["name"] for j in jobs}) == len(jobs)
    only = regime.plan_regime(ex.parse_args(["--stage", "regime", "--seeds", "3", "--regime-rows", "grpo,replace (whole)"]),
                              ["weak-6ops"])
    assert [j["row"] for j in only if j["steps"]] == ["grpo", "replace (whole)"]


def test_bad_regime_flags_fail_at_parsing():
    for bad in (["--regime-starts", "main-ladder,medium"], ["--regime-best", "grpo"], ["--regime-steps", "0"],
                ["--styles", "1"], ["--styles", "4"]):
        with pytest.raises(SystemExit):
            ex.parse_args(["--stage", "regime", *bad])


def test_paired_curves_and_separation_by_hand():
    """Eval points: Δ at each step over the seeds; reward blocks: Δ of the block means; `separates` names the
    first point past 0 whose 95 % interval excludes 0."""
    g = "regime-x"
    results = [_run(g, "grpo", 0, reward=[0.1, 0.2, 0.3, 0.4], eval_acc=[0.2, 0.3]),
               _run(g, "grpo", 1, reward=[0.2, 0.2, 0.2, 0.2], eval_acc=[0.2, 0.4]),
               _run(g, "s", 0, reward=[0.1, 0.3, 0.5, 0.5], eval_acc=[0.2, 0.5]),
               _run(g, "s", 1, reward=[0.2, 0.4, 0.4, 0.6], eval_acc=[0.2, 0.6])]
    ev = regime.paired_curve(results, g, "eval_acc")["s"]
    assert [x for x, _ in ev] == [0, 4] and ev[0][1]["mean"] == pytest.approx(0.0)
    assert ev[1][1]["mean"] == pytest.approx(0.2) and ev[1][1]["lo"] == pytest.approx(0.2)   # Δ 0.2 and 0.2: sd 0
    blocks = regime.paired_curve(results, g, "reward", block=2)["s"]
    # seed 0: (0.2 - 0.15, 0.5 - 0.35) = (0.05, 0.15); seed 1: (0.3 - 0.2, 0.5 - 0.2) = (0.1, 0.3)
    assert [x for x, _ in blocks] == [2, 4]
    assert blocks[0][1]["mean"] == pytest.approx(0.075) and blocks[1][1]["mean"] == pytest.approx(0.225)
    half = 12.7062 * (0.05 / 2 ** 0.5) / 2 ** 0.5      # t(1) * sd / sqrt(2), sd of (0.05, 0.1) = 0.05 / sqrt(2)
    assert blocks[0][1]["lo"] == pytest.approx(0.075 - half, abs=1e-5)
    assert regime.separates(ev) == 4 and regime.separates(blocks) is None
    assert regime.separates([(0, {"lo": 0.1, "hi": 0.2}), (5, {"lo": -0.3, "hi": -0.1})]) == 5
    assert regime.separation_label([(0, {"lo": 0.1, "hi": 0.2}), (5, {"lo": -0.3, "hi": -0.1})]) == "5 (below)"
    assert regime.separation_label(ev) == "4 (above)" and regime.separation_label(blocks) == "no"


def test_starting_all_fail_and_block_means_by_hand():
    g = "regime-x"
    results = [_run(g, "grpo", 0, reward=[0.0] * 4, eval_acc=[0, 0], all_fail=[1.0, 0.5, 0.5, 0.0], first3=0.6),
               _run(g, "grpo", 1, reward=[0.0] * 4, eval_acc=[0, 0], all_fail=[0.5, 0.5, 0.0, 0.0], first3=0.4),
               _run(g, "s", 0, reward=[0.0] * 4, eval_acc=[0, 0], first3=0.9)]
    assert regime.starting_all_fail(results, g) == pytest.approx(0.5)      # GRPO's rows only
    assert regime.block_means(results, g, "all_fail")["grpo"] == [pytest.approx((0.5 + 0.25) / 2)]


def test_ablations_run_only_where_a_scope_row_separates_upward():
    args = ex.parse_args(["--stage", "regime", "--seeds", "0,1"])
    up = [_run("regime-weak-6ops", "grpo", s, reward=[0.1], eval_acc=[0, 0], acc=0.1 + 0.01 * s) for s in (0, 1)] + \
         [_run("regime-weak-6ops", "scope (paper): any/replace", s, reward=[0.1], eval_acc=[0, 0], acc=0.3 + 0.01 * s)
          for s in (0, 1)]
    flat = [_run("regime-main-ladder", "grpo", s, reward=[0.1], eval_acc=[0, 0], acc=0.5 + 0.1 * s) for s in (0, 1)] + \
           [_run("regime-main-ladder", "scope (paper): any/replace", s, reward=[0.1], eval_acc=[0, 0], acc=0.6 - 0.1 * s)
            for s in (0, 1)]
    jobs = regime.plan_ablations(args, up + flat, ["main-ladder", "weak-6ops"])
    assert {j["group"] for j in jobs} == {"regime-weak-6ops"} and len(jobs) == 2 * len(regime.ABLATIONS)
    unit = next(j for j in jobs if j["row"].endswith("unit credit"))
    cmd = studies.scope_command(unit, args)
    assert cmd[cmd.index("--offpolicy-credit") + 1] == "unit" and cmd[cmd.index("--merge") + 1] == "replace"
    forced = ex.parse_args(["--stage", "regime", "--seeds", "0", "--regime-ablations", "main-ladder"])
    assert {j["group"] for j in regime.plan_ablations(forced, flat, ["main-ladder"])} == {"regime-main-ladder"}


def test_ablations_of_the_weakest_start_come_first():
    """Both starts separate; the one with the higher starting all-fail share gets its ablations planned first."""
    args = ex.parse_args(["--stage", "regime", "--seeds", "0,1"])
    results = []
    for group, first3 in (("regime-main-ladder", 0.2), ("regime-weak-ladder", 0.5)):
        results += [_run(group, "grpo", s, reward=[0.1], eval_acc=[0, 0], acc=0.1 + 0.01 * s, first3=first3)
                    for s in (0, 1)]
        results += [_run(group, "scope (paper): any/replace", s, reward=[0.1], eval_acc=[0, 0], acc=0.3 + 0.01 * s,
                         first3=first3) for s in (0, 1)]
    jobs = regime.plan_ablations(args, results, ["main-ladder", "weak-ladder"])
    groups = [j["group"] for j in jobs]
    n = 2 * len(regime.ABLATIONS)
    assert groups == ["regime-weak-ladder"] * n + ["regime-main-ladder"] * n


def test_ablation_deltas_pair_each_ablation_with_the_row_it_ablates():
    g, base = "regime-weak-ladder", "scope (paper): any/replace"
    results = [_run(g, "grpo", s, reward=[0.1], eval_acc=[0, 0], acc=0.1) for s in (0, 1)]
    results += [_run(g, base, s, reward=[0.1], eval_acc=[0, 0], acc=a) for s, a in ((0, 0.30), (1, 0.40))]
    results += [_run(g, f"{base} + unit credit", s, reward=[0.1], eval_acc=[0, 0], acc=a)
                for s, a in ((0, 0.20), (1, 0.20))]
    for r in results:
        r["eval"]["pass@16"] = 0.5
    d = regime.ablation_deltas(results, g)
    assert list(d) == [f"{base} + unit credit"]                     # grpo and the base row are not ablations
    acc = d[f"{base} + unit credit"]["acc_t1"]                      # (0.2 - 0.3, 0.2 - 0.4) = (-0.1, -0.2)
    assert acc["n"] == 2 and acc["mean"] == pytest.approx(-0.15)
    half = 12.7062 * (0.1 / 2 ** 0.5) / 2 ** 0.5                     # t(1) * sd / sqrt(2), sd = 0.1 / sqrt(2)
    assert acc["lo"] == pytest.approx(-0.15 - half, abs=1e-5)
    assert d[f"{base} + unit credit"]["pass@16"]["mean"] == pytest.approx(0.0)


def test_a_record_with_the_same_command_is_read_not_retrained(tmp_path, monkeypatch):
    """A finished run's record stands in for the run when its command and eval settings match; a changed
    command retrains (here: calls run_job, which the test replaces)."""
    args = ex.parse_args(["--stage", "regime", "--seeds", "0", "--out", str(tmp_path)])
    j = next(j for j in regime.plan_regime(args, ["main-ladder"]) if j["steps"])
    settings = {k: getattr(args, k) for k in ("eval_size", "eval_n", "eval_n_cool", "eval_seed", "max_new_tokens")}
    path = regime.record_path(j, args)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"command": studies.scope_command(j, args)[1:], "start": j["start"], "eval_settings": settings,
                   "result": {"name": j["name"], "eval": {"acc_t1": 0.25}}}, f)
    calls = []
    monkeypatch.setattr(studies, "run_job", lambda job, a: calls.append(job) or {"stub": True})
    assert regime.run_recorded(j, args)["eval"]["acc_t1"] == 0.25 and not calls
    args.max_new_tokens = 96                     # another command: the record is stale
    with pytest.raises(Exception):
        regime.run_recorded(j, args)             # the replaced run_job returns no runs/ folder to read
    assert len(calls) == 1


def test_repairs_are_counted_per_block_and_position(tmp_path):
    traces = [{"accepted": True, "step": 1, "cut": 0, "steps": ["a", "b"], "group_all_fail": True},
              {"accepted": True, "step": 25, "cut": 1, "steps": ["a", "b"], "group_all_fail": False},
              {"accepted": False, "step": 2, "cut": 1, "steps": ["a", "b"], "group_all_fail": True}]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    r = regime.repairs_of(str(tmp_path), 40)
    assert r["accepted"] == 2 and r["per_block"] == [1, 1] and r["in_all_fail_groups"] == pytest.approx(0.5)
    assert r["cut_relative_hist"] == [1, 0, 1, 0, 0]      # cuts at 0/2 and 1/2


def test_diversity_plan_and_report_by_hand():
    """The diversity stage trains grpo and SCOPE (paper) from the styles warm start with --toy-styles, and
    reports the paired Δ of the final style entropy (hand numbers: Δ 0.2 and 0.4 -> mean 0.3)."""
    args = ex.parse_args(["--stage", "diversity", "--seeds", "0,1", "--styles", "3"])
    jobs = regime.plan_diversity(args)
    trained = [j for j in jobs if j["steps"]]
    assert [j["row"] for j in trained] == list(regime.DIVERSITY_ROWS) * 2
    cmd = studies.scope_command(trained[1], args)
    assert cmd[cmd.index("--toy-styles") + 1] == "3" and cmd[cmd.index("--steps") + 1] == "100"
    assert studies.start_settings(trained[1], args) == {"styles": 3} and "--model" in cmd

    def run(row, seed, entropy):
        return {"group": "diversity", "row": row, "seed": seed, "steps": 4, "name": f"{row}{seed}",
                "eval": {"style_entropy": entropy, "style_share": [0.5, 0.25, 0.25], "acc_t1": 0.5},
                "train": {"curve": {"style_entropy_correct": [0.1, None, 0.3, 0.5]}}}

    results = [run("grpo", 0, 0.5), run("grpo", 1, 0.6),
               run("scope (paper): any/replace", 0, 0.7), run("scope (paper): any/replace", 1, 1.0)]
    text, summary = regime.diversity_report(results, args, 1.0, "cmd")
    d = summary["final"]["scope (paper): any/replace"]["style_entropy"]
    assert d["n"] == 2 and d["mean"] == pytest.approx(0.3)
    assert "0.50 / 0.25 / 0.25" in text


# ---------------------------------------------------------------- the because stage (tools/studies/why_it_helps.py)

def test_because_plan_is_seed_major_with_the_new_switches():
    from tools.studies import why_it_helps as because

    args = ex.parse_args(["--stage", "because", "--seeds", "0,1"])
    args.eval_n_cool, args.train_eval_size = 0, args.regime_eval_size
    jobs = because.plan(args)
    assert len(jobs) == 12 and [j["seed"] for j in jobs] == [0] * 5 + [1] * 5 + [0, 1]   # the added cell last
    added = jobs[-1]
    strong = next(j for j in regime.plan_regime(args, ["main-ladder"]) if j["row"] == "best: scope any/append")
    assert added["group"] == strong["group"] and studies.start_path(added, args) == studies.start_path(strong, args)
    whole_append = studies.scope_command(added, args)
    assert whole_append[whole_append.index("--mode") + 1] == "replace"
    assert whole_append[whole_append.index("--merge") + 1] == "append"
    cmd = {j["row"]: studies.scope_command(j, args) for j in jobs if j["seed"] == 0}
    assert cmd["keep-foreign"][-5:] == ["--merge", "replace", "--toy-refiner-style", "1", "--seed", "0"][-5:]
    assert "--repair-advantage" in cmd["keep-in-style-phantom"] and "--toy-styles" not in cmd["keep-foreign"]
    assert cmd["whole-foreign"][cmd["whole-foreign"].index("--mode") + 1] == "replace"
    assert {"--select-tiebreak", "--toy-styles"} <= set(cmd["scope index tie-break"])
    teacher = cmd["whole one-style teacher"]
    assert teacher[teacher.index("--toy-refiner-style") + 1] == "1" and teacher[teacher.index("--mode") + 1] == "replace"
    weak = next(j for j in jobs if j["row"] == "keep-foreign")
    ref = next(j for j in regime.plan_regime(args, ["weak-ladder"]) if j["row"] == "grpo")
    assert studies.start_path(weak, args) == studies.start_path(ref, args) and weak["group"] == ref["group"]
    assert studies.eval_styles(weak, args) == 3 and studies.eval_styles(ref, args) == 1


def test_contrast_by_seed_and_the_interaction_by_hand():
    """(kF − wF) − (kI − wI) per seed: seed 0 (0.3 − 0.1) − (0.2 − 0.2) = 0.2; seed 1 (0.2 − 0.2) − (0.1 − 0.2) = 0.1;
    seed 2 lacks a row and is left out. Mean 0.15, sd 0.1 / √2, t(1) interval."""
    from tools.studies import why_it_helps as because

    acc = {("kF", 0): 0.3, ("wF", 0): 0.1, ("kI", 0): 0.2, ("wI", 0): 0.2,
           ("kF", 1): 0.2, ("wF", 1): 0.2, ("kI", 1): 0.1, ("wI", 1): 0.2, ("kF", 2): 0.5}
    results = [{"group": "g", "row": row, "seed": s, "steps": 1, "eval": {"acc_t1": a}, "train": {}}
               for (row, s), a in acc.items()]
    by = because.contrast_by_seed(results, "g", {"kF": 1, "wF": -1, "kI": -1, "wI": 1})
    assert list(by) == [0, 1] and by[0] == pytest.approx(0.2) and by[1] == pytest.approx(0.1)
    c = studies.ci95(list(by.values()))
    assert c["mean"] == pytest.approx(0.15) and c["lo"] == pytest.approx(0.15 - 12.7062 * 0.05, abs=1e-5)
    assert because.verdict(c, 0.02) == "cannot tell"
    assert because.verdict({"lo": 0.01, "hi": 0.3}, 0.02) == "> 0"
    assert because.verdict({"lo": -0.01, "hi": 0.015}, 0.02) == "≈ 0"
    # per-problem matrix: kF has counts (16 samples), the others enter with their acc on every problem
    results[0]["eval"]["per_problem_correct"] = [16, 0]          # seed 0's kF: 1.0 and 0.0, mean 0.5
    D = because.per_problem_matrix(results, "g", {"kF": 1, "wF": -1}, [0, 1])
    assert D.tolist() == [pytest.approx([0.9, -0.1]), pytest.approx([0.0, 0.0])]


def test_t_quantile_and_interval_by_hand():
    """The 95 % t quantile from scipy, against the printed table (a hand table fell back to 1.96 past 11 seeds,
    too narrow): df 1 12.706, 4 2.776, 20 2.086, 30 2.042; the interval of [1, 2, 3, 4, 5]: mean 3, sd √2.5,
    half-width 2.776 · √2.5 / √5 = 1.963."""
    for df, t in ((1, 12.706), (4, 2.776), (10, 2.228), (20, 2.086), (30, 2.042), (100, 1.984)):
        assert studies.t975(df) == pytest.approx(t, abs=5e-4)
    c = studies.ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert c["n"] == 5 and c["mean"] == 3.0 and c["hi"] - 3.0 == pytest.approx(1.963, abs=1e-3)
    wide = studies.ci95([float(i % 2) for i in range(21)])   # 20 degrees of freedom: 2.086, not 1.96
    assert (wide["hi"] - wide["lo"]) / 2 == pytest.approx(2.086 * np.std([i % 2 for i in range(21)], ddof=1)
                                                          / np.sqrt(21), rel=1e-3)
    assert studies.ci95([0.4])["lo"] is None and studies.ci95([])["n"] == 0


def test_seed_problem_bootstrap_by_hand():
    """One seed, two problems with contrasts 0 and 1: a draw of 2 problems gives a mean of 0, 0.5 or 1 with
    chances 1/4, 1/2, 1/4, so the 95 % percentile interval is [0, 1]. A constant matrix gives its constant."""
    from tools.studies import why_it_helps as because

    b = because.seed_problem_bootstrap(np.array([[0.0, 1.0]]), draws=4000, seed=1)
    assert b["mean"] == 0.5 and b["lo"] == 0.0 and b["hi"] == 1.0
    c = because.seed_problem_bootstrap(np.full((3, 4), 0.25), draws=200)
    assert (c["lo"], c["hi"]) == (pytest.approx(0.25), pytest.approx(0.25))
    # two seeds whose contrasts are 0 and 1 on every problem: the seed draw alone gives 0, 0.5, 1
    d = because.seed_problem_bootstrap(np.array([[0.0] * 3, [1.0] * 3]), draws=4000, seed=2)
    assert (d["lo"], d["hi"]) == (0.0, 1.0)


def test_holm_by_hand():
    """p = 0.01, 0.04, 0.03, 0.005 (m = 4): sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04
    → running max 0.06; in the input order 0.03, 0.06, 0.06, 0.02. Capped at 1."""
    from tools.studies import why_it_helps as because

    assert because.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert because.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    assert because.holm([]) == []


def test_paired_p_by_hand():
    """diffs 1, 2, 3: mean 2, sd 1, t = 2 / (1 / √3) = 3.464 with 2 df → two-sided p = 0.0742."""
    from tools.studies import why_it_helps as because

    assert because.paired_p([1.0, 2.0, 3.0]) == pytest.approx(0.0742, abs=2e-4)
    assert because.paired_p([1.0]) is None and because.paired_p([0.0, 0.0]) == 1.0


def test_because_report_marks_a_partial_study_and_pairs_the_interaction():
    """Two seeds of the four weak-ladder rows, the new ones with 4 problems all at the same count (hand numbers:
    K1 = (5/16 − 2/16) − (0.2 − 0.2) = 0.1875 on seed 0, (3/16 − 3/16) − (0.1 − 0.2) = 0.1 on seed 1 → mean
    0.14375; every problem alike, so the bootstrap moves with the seed draw only: [0.1, 0.1875]). The report
    names itself partial (8 of the 30 planned runs: 25 pre-registered, 5 added)."""
    from tools.studies import why_it_helps as because

    args = ex.parse_args(["--stage", "because"])
    g = "regime-weak-ladder"
    acc = {("keep-foreign", 0): 5 / 16, ("whole-foreign", 0): 2 / 16, (because.KEEP_I, 0): 0.2, (because.WHOLE_I, 0): 0.2,
           ("keep-foreign", 1): 3 / 16, ("whole-foreign", 1): 3 / 16, (because.KEEP_I, 1): 0.1, (because.WHOLE_I, 1): 0.2}
    runs = [{"group": g, "row": row, "seed": s, "steps": 100, "name": f"{row}-{s}", "wall_s": {"train": 60, "eval": 0},
             "eval": {"acc_t1": a, "pass@16": 0.5, **({"per_problem_correct": [round(a * 16)] * 4}
                                                      if row in because.WEAK_ROWS else {})}, "train": {}}
            for (row, s), a in acc.items()]
    new = [r for r in runs if r["row"] in because.WEAK_ROWS] * 2         # 8 "new" records
    text, summary = because.report(new, [r for r in runs if r["row"] not in because.WEAK_ROWS], args, 0.0)
    assert "PARTIAL: 8 of 30 runs" in text
    k1 = summary["contrasts"]["K1 interaction (keep − whole | foreign) − (keep − whole | in-style)"]
    assert k1["t"]["mean"] == pytest.approx(0.14375) and k1["seeds"] == [0, 1]
    assert k1["bootstrap"]["lo"] == pytest.approx(0.1) and k1["bootstrap"]["hi"] == pytest.approx(0.1875)
