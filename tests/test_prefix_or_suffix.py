"""Tests of the credit-split follow-up (tools/studies/prefix_or_suffix.py) and what it stands on: --repair-credit's masks, its
plan and records, the fixed-set π measurement, the reading rule, and the records' environment fields."""
import json
import os
import subprocess

import pytest
import torch

from tools.studies import content_or_mean_shift as b2
from tools.studies import prefix_or_suffix as b3
from tools.studies import where_it_helps as ex
from tools.studies import common as studies


def args_(out="results/toy"):
    a = ex.parse_args(["--out", str(out)])
    a.stage, a.eval_n_cool, a.train_eval_size = b3.STAGE, 0, a.regime_eval_size
    return a


def _traj(source, ids, off):
    from refine import Trajectory

    return Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=ids, text="t",
                      offpolicy_mask=off, source=source)


def test_repair_credit_keeps_only_the_named_part_of_a_repair_in_the_loss():
    """Rows: a policy rollout (3 tokens), a prefix-keeping repair (2 kept + 2 refiner tokens), a whole
    replacement (2 refiner tokens); one prompt token each. `prefix` drops the refiner tokens of repairs, `suffix`
    their kept tokens; the policy's own rollout and the advantages never change."""
    from grpo import build_batch
    from refine import repair_credit_only

    trajs = [_traj("policy", [5, 6, 7], [0, 0, 0]), _traj("rectified", [5, 6, 8, 9], [0, 0, 1, 1]),
             _traj("replaced", [8, 9], [1, 1])]
    batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                        [t.offpolicy_mask for t in trajs], [-0.5, 1.0, 1.0], 0)
    assert repair_credit_only(batch, trajs, "all") is batch
    prefix = repair_credit_only(batch, trajs, "prefix")
    assert prefix["response_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert prefix["offpolicy_mask"].tolist() == [[0] * 5] * 3
    suffix = repair_credit_only(batch, trajs, "suffix")
    assert suffix["response_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]
    assert suffix["offpolicy_mask"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]
    for out in (prefix, suffix):
        torch.testing.assert_close(out["advantages"], torch.tensor([-0.5, 1.0, 1.0]))
        assert out["input_ids"] is batch["input_ids"] and out["response_mask"].shape[0] == 3   # N unchanged


def test_repair_credit_defaults_to_all():
    import scope

    assert scope.parse_args(["--toy"]).repair_credit == "all"
    assert scope.parse_args(["--toy", "--repair-credit", "suffix"]).repair_credit == "suffix"


@pytest.mark.slow
def test_a_step_with_prefix_or_suffix_credit_trains_only_that_part(tmp_path):
    """One toy step of seed 0 under each setting (the same rollouts and repairs): the refiner's share of the loss
    tokens is 0 with prefix credit only and larger than SCOPE's with suffix credit only."""
    from test_study_flags import run_toy

    share = {}
    for part in ("all", "prefix", "suffix"):
        _, metrics = run_toy(tmp_path / part, "--repair-credit", part, steps=1)
        assert metrics[0]["rectify_accepted"] > 0
        share[part] = metrics[0]["offpolicy_share"]
    assert share["prefix"] == 0.0 and 0.0 < share["all"] < share["suffix"]


def test_plan_pairs_the_cells_by_seed_then_retrains_because2s_scope_runs():
    args = args_()
    jobs = b3.plan(args)
    runs = [j for j in jobs if j["kind"] == "run"]
    assert [(j["row"], j["seed"]) for j in runs[:4]] == [(b3.PREFIX, 0), (b3.SUFFIX, 0), (b3.PREFIX, 1), (b3.SUFFIX, 1)]
    assert len(runs) == 26 and {j["seed"] for j in runs} == set(range(13))
    for j in runs:
        cmd = b2.command(j, args)
        part = cmd[cmd.index("--repair-credit") + 1]
        assert part == ("prefix" if j["row"] == b3.PREFIX else "suffix") and cmd[-2:] == ["--save-every", "25"]
    retrain = [j for j in jobs if j["kind"] == "retrain"]
    assert [j["seed"] for j in retrain] == list(range(5, 13))
    for j in retrain:   # exactly the command of because2's record of that seed
        rec = studies.read_json(os.path.join("results/toy/because2/records", j["name"] + ".json"))
        if rec is not None:
            assert studies.as_now(rec["command"]) == b2.record_key(j, args)[0]


def test_a_record_of_another_command_is_never_replaced(tmp_path):
    args = args_(tmp_path)
    j = b3.plan(args)[0]
    path = b3.record_path(j, args)
    os.makedirs(os.path.dirname(path))
    cmd, settings = b2.record_key(j, args)
    with open(path, "w") as f:
        json.dump({"command": cmd, "eval_settings": settings, "result": {"x": 1}}, f)
    assert b3.recorded(j, args) == {"x": 1}
    with open(path, "w") as f:
        json.dump({"command": cmd + ["--lr", "1"], "eval_settings": settings, "result": {"x": 1}}, f)
    with pytest.raises(SystemExit, match="never replaced"):
        b3.recorded(j, args)


def test_tracking_follows_one_fixed_set_of_repairs_from_its_origin_on(tmp_path, monkeypatch):
    """Guards against re-selecting the repairs at each checkpoint (which compares different tokens). Repairs
    accepted at steps 1, 3, 26, 30 and 52 (53 rejected): origin 0's set is steps 1 and 3 under every checkpoint
    (0, 25, 50, 75, 100), origin 25's steps 26 and 30 from checkpoint 25 on, origin 50's step 52 from 50 on."""
    from harness.engines import generate

    run = tmp_path / "run"
    for c in (25, 50, 75, 100):
        os.makedirs(run / "checkpoints" / f"step-{c}")
    os.makedirs(tmp_path / "start")
    with open(run / "traces.jsonl", "w") as f:
        for step in (1, 3, 26, 30, 52, 53):
            f.write(json.dumps({"step": step, "accepted": step != 53}) + "\n")
    seen = []

    class Checkpoint:
        def __init__(self, path):
            self.step = 0 if path.endswith("start") else int(path.split("-")[-1])

        def eval(self):
            pass

    def probs(model, tok, trace):   # π: 0.9 on the kept token, the checkpoint's step / 100 on the corrected one
        seen.append((model.step, trace["step"]))
        return [0.9, model.step / 100, 0.5], 1, 0

    monkeypatch.setattr(generate, "load_causal_lm", lambda path, device: (Checkpoint(path), None))
    monkeypatch.setattr(studies, "repair_token_probs", probs)
    monkeypatch.setattr(studies, "mean", lambda xs: sum(xs) / len(xs) if xs else None)
    out = b3.tracking(str(run), str(tmp_path / "start"))
    assert sorted(out) == ["0", "25", "50"]
    assert sorted(out["0"], key=int) == ["0", "25", "50", "75", "100"]
    assert sorted(out["25"], key=int) == ["25", "50", "75", "100"] and sorted(out["50"], key=int) == ["50", "75", "100"]
    assert all(x["repairs"] == 2 for x in out["0"].values()) and out["50"]["100"]["repairs"] == 1
    assert {s for m, s in seen if m == 100} == {1, 3, 26, 30, 52}       # every set, under the last checkpoint
    assert {s for m, s in seen if m == 0} == {1, 3}                     # the start sees only origin 0's set
    assert out["0"]["75"]["corrected_pi"] == pytest.approx(0.75) and out["0"]["75"]["kept_pi"] == pytest.approx(0.9)


def _c(mean, lo, hi, n=13):
    return {"t": {"mean": mean, "lo": lo, "hi": hi, "n": n}}


@pytest.mark.parametrize("p_scope, s_scope, p_phantom, answer", [
    ((-0.03, -0.05, -0.01), (-0.04, -0.06, -0.02), (0.01, -0.01, 0.03), "both parts add"),
    ((-0.005, -0.015, 0.005), (-0.04, -0.06, -0.02), (0.035, 0.02, 0.05), "the kept prefix's credit carries"),
    ((-0.04, -0.06, -0.02), (0.0, -0.01, 0.01), (0.0, -0.02, 0.02), "the refiner suffix's credit carries"),
    ((-0.01, -0.03, 0.01), (-0.01, -0.03, 0.01), (0.03, 0.01, 0.05), "cannot tell"),
    ((-0.005, -0.015, 0.005), (-0.04, -0.06, -0.02), (0.01, -0.01, 0.03), "cannot tell"),
])
def test_the_reading_rule_in_its_preregistered_order(p_scope, s_scope, p_phantom, answer):
    con = {"prefix-only − SCOPE in style": _c(*p_scope), "suffix-only − SCOPE in style": _c(*s_scope),
           "prefix-only − phantom": _c(*p_phantom)}
    assert answer in b3.reading(con)
    con["prefix-only − phantom"]["t"]["n"] = 12
    assert b3.reading(con) == "partial: no reading"


def test_holm_adjusts_hand_numbers():
    """p = 0.01, 0.04, 0.03: sorted 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → raised to 0.06 (monotone)."""
    assert b3.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert b3.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_environment_names_cpu_kernels_threads_and_a_dirty_trees_files(tmp_path, monkeypatch):
    """In a scratch repository: clean, then one tracked file changed to "hello\\n" (git blob
    ce013625…) and one deleted; the study refuses the dirty tree in one line."""
    from harness.run import runs

    repo = tmp_path / "repo"
    os.makedirs(repo / "harness" / "run")
    for name, text in (("a.txt", "a\n"), ("b.txt", "b\n"), ("harness/run/runs.py", "")):
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(runs, "__file__", str(repo / "harness" / "run" / "runs.py"))
    env = runs.environment()
    assert env["dirty"] is False and env["changed"] == {}
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["torch_threads"] >= 1
    assert env["cpu_flags"] is None or set(env["cpu_flags"]) <= set(runs.NUMERICS_FLAGS)
    (repo / "a.txt").write_text("hello\n")
    os.remove(repo / "b.txt")
    env = runs.environment()
    assert env["dirty"] is True
    assert env["changed"] == {"a.txt": "ce013625030ba8dba906f756967f9e9ca394464a", "b.txt": None}
    monkeypatch.setattr("harness.run.runs.environment", lambda: env)
    with pytest.raises(RuntimeError, match="differs from commit .*a.txt, b.txt"):
        b3.clean_environment()
