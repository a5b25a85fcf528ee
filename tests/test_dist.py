"""torchrun on this CPU: two processes, gloo, every launch bounded in time so a deadlock fails instead of hanging.

- the gradient check (tests/dist_worker.py): in float64 the gradient DDP and FSDP2 hand the optimizer equals the
  one-process gradient of the same global batch, for equal and ragged groups (`--merge append`) and both loss
  aggregations; the ragged cases give the ranks different micro-batch counts (a deadlock without the equal count)
  and need the global normaliser; the FSDP2 cases generate through the sharded model first and need the reshard;
- `scope.py --toy` under torchrun: one step, then a resume under torchrun for the second, give the metrics of a
  one-process 2-step run (to float32 tolerance), written once by rank 0 in one run folder.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_scope

LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch(args, cwd, timeout=150):
    """A 2-process torchrun launch; a non-zero exit or a timeout fails with its output."""
    try:
        proc = subprocess.run([*LAUNCH, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun {' '.join(args)} ran past {timeout} s (a deadlock?):\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"torchrun {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_ddp_and_fsdp2_gradients_equal_the_one_process_gradient(tmp_path):
    """Guards against a local normaliser (wrong gradients with ragged groups or token-mean), a rank-dependent
    micro-batch count (a deadlock), and a root FSDP2 unit left unsharded after generation (the optimizer's
    parameters get no gradient; the clipped norm is wrong)."""
    out = tmp_path / "grads.json"
    launch([os.path.join(ROOT, "tests", "dist_worker.py"), str(out)], cwd=tmp_path)
    results = json.loads(out.read_text())
    cases = [f"{w}-{g}-{agg}" for w in ("ddp", "fsdp") for g in ("equal", "ragged") for agg in ("constant", "token-mean")]
    assert sorted(results) == sorted(cases)
    for case, r in results.items():
        assert r["grad_norm_ref"] > 0.05, case                       # a real gradient, far above the tolerance
        assert r["max_diff"] < 1e-12, (case, r)
        assert abs(r["grad_norm"] - r["grad_norm_ref"]) < 1e-12, (case, r)
        assert abs(r["loss"] - r["loss_ref"]) < 1e-12, (case, r)
        if "ragged" in case:
            assert r["rows"] == [6, 4], (case, r)                     # 3 vs 2 micro-batches of 2


@pytest.mark.slow
def test_torchrun_toy_run_and_resume_match_one_process(tmp_path, toy_model_dir):
    common = ["--toy", "--model", toy_model_dir, "--prompts-per-step", "4", "--group-size", "4",
              "--max-new-tokens", "64", "--micro-batch-size", "4", "--eval-every", "2", "--eval-size", "8",
              "--save-every", "1", "--merge", "append", "--dist-timeout", "60"]
    run_scope([*common, "--steps", "2", "--run-name", "one"], cwd=tmp_path)
    launch([os.path.join(ROOT, "scope.py"), *common, "--steps", "1", "--run-name", "two"], cwd=tmp_path)
    assert not (tmp_path / "runs" / "two" / "lock").exists()
    launch([os.path.join(ROOT, "scope.py"), "--resume", "runs/two", "--steps", "2"], cwd=tmp_path)
    one, two = (read_jsonl(tmp_path / "runs" / name / "metrics.jsonl") for name in ("one", "two"))
    assert [m["step"] for m in two] == [0, 1, 2]                      # rank 0 alone wrote: each step once
    assert sum(m["rectify_tried"] for m in one[1:]) > 0               # the repairs are part of what is compared
    two[1].pop("eval_acc")                                            # the 1-step launch evaluated at its end
    for a, b in zip(one, two):
        assert set(a) == set(b)
        for key in a:
            if key.startswith("time_") or key == "pad_share":   # padding depends on each rank's rows
                continue
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
            else:
                assert b[key] == a[key], (a["step"], key)
    traces_one, traces_two = (read_jsonl(tmp_path / "runs" / n / "traces.jsonl") for n in ("one", "two"))
    assert [(t["step"], t["group"], t["accepted"]) for t in traces_two] == \
           [(t["step"], t["group"], t["accepted"]) for t in traces_one]
    assert (tmp_path / "runs" / "two" / "checkpoint" / "optimizer.pt").is_file()
