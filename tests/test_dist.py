"""torchrun on this CPU: two processes, gloo, every launch bounded in time so a deadlock fails instead of hanging.

- the gradient check (tests/dist_worker.py): in float64 the gradient DDP and FSDP2 hand the optimizer equals the
  one-process gradient of the same global batch, for equal and ragged groups (`--merge append`) and both loss
  aggregations; the ragged cases give the ranks different micro-batch counts (a deadlock without the equal count)
  and need the global normaliser; the FSDP2 cases generate through the sharded model first and need the reshard;
- `scope.py --toy` under torchrun: one step, then a resume under torchrun for the second, give the metrics of a
  one-process 2-step run (to float32 tolerance), written once by rank 0 in one run folder;
- the FSDP2 weight push (dist.FullView) in a one-process gloo group: one full tensor gathered at a time.

The torchrun launches are `slow` (tens of seconds each on 2 cores); one more runs `--updates-per-batch 2` under
FSDP2 with ragged groups (the π_old pass and both steps keep the ranks' forward counts equal). Their time bounds
(`bounds`) scale with the machine's load, so a busy machine makes a launch slower, never a failure: a rank that
waits for a starved peer is not a deadlock.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, pace, run_scope

LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def bounds() -> tuple[int, int]:
    """(seconds a rank may wait in a collective, seconds a whole launch may take) on this machine now: 300 and
    900 on a quiet machine (a launch takes 20-60 s there), times the 1-minute load average per core when that is
    above 1. The collective bound stays below the launch's, so a real deadlock still ends in gloo's error, with
    each rank's traceback, before the launch is killed."""
    return round(300 * pace()), round(900 * pace())


def launch(args, cwd):
    """A 2-process torchrun launch; a non-zero exit or a timeout (`bounds`) fails with its output."""
    timeout = bounds()[1]
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
    micro-batch count (a deadlock), a root FSDP2 unit left unsharded after generation (the optimizer's
    parameters get no gradient; the clipped norm is wrong), and FSDP2 micro-batches run without their
    reduce-scatter (every rank then keeps a full-size fp32 gradient: the 8-GPU 7B run's first update ran out
    of memory)."""
    out = tmp_path / "grads.json"
    launch([os.path.join(ROOT, "tests", "dist_worker.py"), str(out), str(bounds()[0])], cwd=tmp_path)
    results = json.loads(out.read_text())
    probe = results.pop("probe")["unsharded_after_backward"]
    assert probe and probe[0] > 0                                     # the count sees a no_sync backward's gradients
    cases = [f"{w}-{g}-{agg}" for w in ("ddp", "fsdp") for g in ("equal", "ragged") for agg in ("constant", "token-mean")]
    assert sorted(results) == sorted(cases)
    for case, r in results.items():
        assert r["grad_norm_ref"] > 0.05, case                       # a real gradient, far above the tolerance
        assert r["max_diff"] < 1e-12, (case, r)
        assert abs(r["grad_norm"] - r["grad_norm_ref"]) < 1e-12, (case, r)
        assert abs(r["loss"] - r["loss_ref"]) < 1e-12, (case, r)
        if "ragged" in case:
            assert r["rows"] == [6, 4], (case, r)                     # 3 vs 2 micro-batches of 2
        if case.startswith("fsdp"):   # FSDP2 reduce-scatters every micro-batch: no full-size gradient is kept
            assert len(r["unsharded_after_backward"]) >= 2, (case, r)
            assert r["unsharded_after_backward"] == [0] * len(r["unsharded_after_backward"]), (case, r)


@pytest.mark.slow
def test_torchrun_toy_run_and_resume_match_one_process(tmp_path, toy_model_dir):
    common = ["--toy", "--model", toy_model_dir, "--prompts-per-step", "4", "--group-size", "4",
              "--max-new-tokens", "64", "--micro-batch-size", "4", "--eval-every", "2", "--eval-size", "8",
              "--save-every", "1", "--merge", "append", "--dist-timeout", str(bounds()[0])]
    run_scope([*common, "--steps", "2", "--run-name", "one"], cwd=tmp_path, timeout=bounds()[1])
    launch([os.path.join(ROOT, "scope.py"), *common, "--steps", "1", "--run-name", "two"], cwd=tmp_path)
    assert not (tmp_path / "runs" / "two" / "lock").exists()
    launch([os.path.join(ROOT, "scope.py"), "--resume", "runs/two", "--steps", "2"], cwd=tmp_path)
    one, two = (read_jsonl(tmp_path / "runs" / name / "metrics.jsonl") for name in ("one", "two"))
    assert [m["step"] for m in two] == [0, 1, 2]                      # rank 0 alone wrote: each step once
    assert sum(m["rectify_tried"] for m in one[1:]) > 0               # the repairs are part of what is compared
    two[1].pop("eval_acc"), two[1].pop("time_eval")                   # the 1-step launch evaluated at its end
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


def test_fsdp2_weight_push_gathers_one_full_tensor_at_a_time(tmp_path, monkeypatch):
    """Guards the push that built the whole fp32 model at once (dist.FullView called full_tensor() on every
    parameter before the first reached vLLM: 28 GiB per rank for 7B). An FSDP2 model in a one-process gloo
    group is pushed through FullView by generate.sync_weights itself (into a stand-in engine whose reload walks
    the weights iterator, as vLLM's does); when each full
    tensor is gathered, at most one earlier full tensor may still be alive (the consumer's loop variable)."""
    import copy
    import weakref
    from types import SimpleNamespace

    import torch
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import dist_worker
    from harness.engines import dist, generate

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = dist.wrap(copy.deepcopy(dist_worker.tiny_model()), dist.Dist(), fsdp=True)
        alive, events = [], []
        gather = DTensor.full_tensor

        def full_tensor(self, *args, **kwargs):
            events.append(("gather", sum(r() is not None for r in alive)))   # full tensors alive before this one
            full = gather(self, *args, **kwargs).clone()    # one process: the local shard is the full tensor
            alive.append(weakref.ref(full))
            return full

        monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        class Engine:   # the parts of vllm.LLM that sync_weights calls
            model_config = SimpleNamespace(dtype=torch.bfloat16)

            def collective_rpc(self, method, kwargs):   # vLLM's reload_weights: one weight at a time
                for name, tensor in kwargs["weights_iterator"]:
                    events.append(("push", name))

            def reset_prefix_cache(self):
                return True

        generate.sync_weights(dist.FullView(model), Engine())
    finally:
        tdist.destroy_process_group()
    gathers = [n for kind, n in events if kind == "gather"]
    pushes = [n for kind, n in events if kind == "push"]
    assert len(gathers) == len(pushes) == len(list(model.parameters())) > 10
    assert [kind for kind, _ in events] == ["gather", "push"] * len(pushes)   # interleaved, not all gathered first
    assert max(gathers) <= 1, gathers


def test_each_rank_resumes_its_own_cuda_rng_state(tmp_path, monkeypatch):
    """Guards the resume in which every rank restored rank 0's CUDA RNG states. Two ranks on faked GPUs: rank 0
    checkpoints (Run.checkpoint, which gathers each rank's state of its own GPU), then each rank restores the
    checkpoint (wiring.restore_checkpoint) and must get back the state its own GPU had."""
    from types import SimpleNamespace

    import torch

    from harness.run import wiring

    own = {0: torch.tensor([10, 11], dtype=torch.uint8), 1: torch.tensor([20, 21], dtype=torch.uint8)}
    current, restored = {"rank": 0}, {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": own[current["rank"]].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [own[0].clone(), own[0].clone()])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.__setitem__(current["rank"], s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: restored.__setitem__(current["rank"], states[current["rank"]]))

    class TwoRanks(wiring.dist.Dist):   # rank 0 of 2; the all-gather brings rank 1's own state
        def all_gather(self, obj):
            return [obj, own[1].clone()]

        def barrier(self):
            pass

    class Saved:
        def save_pretrained(self, path):
            os.makedirs(path, exist_ok=True)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    run = SimpleNamespace(policy=Saved(), optimizer=optimizer, tokenizer=Saved(), args=SimpleNamespace(fsdp=False, lora_rank=0),
                          dist=TwoRanks(rank=0, world=2), run_dir=str(tmp_path))
    wiring.Run.checkpoint(run, 1)
    for rank in (0, 1):
        current["rank"] = rank
        wiring.restore_checkpoint(str(tmp_path / "checkpoint"), optimizer, "cpu", rank=rank)
    assert restored[0].tolist() == [10, 11] and restored[1].tolist() == [20, 21]


@pytest.mark.slow
def test_torchrun_two_updates_per_batch_run_the_same_forwards_on_every_rank(tmp_path, toy_model_dir):
    """--updates-per-batch 2 under torchrun with FSDP2 and --merge append (ragged groups: the ranks' micro-batch
    counts differ): the no-grad π_old pass and both optimizer steps run as many forwards on every rank (FSDP2
    all-gathers in each; a rank-dependent count deadlocks), and every step trains (none skipped)."""
    launch([os.path.join(ROOT, "scope.py"), "--toy", "--model", toy_model_dir, "--prompts-per-step", "4",
            "--group-size", "4", "--max-new-tokens", "64", "--micro-batch-size", "2", "--eval-every", "0",
            "--merge", "append", "--updates-per-batch", "2", "--fsdp", "--dist-timeout", str(bounds()[0]),
            "--steps", "2", "--run-name", "k2"], cwd=tmp_path)
    rows = read_jsonl(tmp_path / "runs" / "k2" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["skipped"] == 0 and m["grad_norm"] > 0 for m in rows), rows
