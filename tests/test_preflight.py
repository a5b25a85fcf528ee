"""The pre-flight (preflight.py, scope.main's first block): every refusal is one line, exit code 2, before any
model loads, and leaves no run folder; the memory plan's numbers; the data checks; the no-network path.

In-process tests call scope.main(scope.parse_args([...])) in an empty working directory (the refusals happen
before anything is imported or loaded, so they take milliseconds); a few subprocess tests check the real
entry point (exit code, one line, seconds, no traceback). Each regression test's docstring names the bug it guards.
"""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conftest import pace  # noqa: E402
from harness.plan import memory  # noqa: E402
from harness.run import preflight  # noqa: E402
import scope  # noqa: E402

OFFLINE_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9"}   # a closed port: the hub probe fails at once


def refused(argv, tmp_path, monkeypatch, capsys) -> str:
    """Run scope.main on argv in tmp_path; assert exit code 2, one line on stderr, no run folder. The line."""
    monkeypatch.chdir(tmp_path)
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as exc:
        scope.main(scope.parse_args(argv))
    assert exc.value.code == 2, exc.value.code
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "runs").exists(), "a refused run left a run folder"
    return err[0]


@pytest.mark.parametrize("flags, culprit", [
    (["--group-size", "0"], "--group-size 0"),
    (["--group-size", "1"], "--group-size 1"),         # silently accepted before: loss and gradient 0 every step
    (["--lr", "-1"], "--lr -1"),
    (["--prompts-per-step", "0"], "--prompts-per-step 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--save-every", "0"], "--save-every 0"),          # was a ZeroDivisionError after step 1
    (["--micro-batch-size", "0"], "--micro-batch-size 0"),
    (["--refine-attempts", "0"], "--refine-attempts 0"),
    (["--toy-prm-noise", "1.5"], "--toy-prm-noise 1.5"),
    (["--tau", "2"], "--tau 2"),                        # silently made every repair a whole-solution replacement
    (["--tau", "0"], "--tau 0"),
    (["--steps", "0"], "--steps 0"),                    # printed a checkpoint path that did not exist
    (["--eval-size", "-1"], "--eval-size -1"),
    (["--temperature", "0"], "--temperature 0"),
    (["--prm", "none"], "--prm none"),                  # mode scope needs a PRM
    (["--refiner-mem", "1.5"], "--refiner-mem 1.5"),
    (["--refiner-timeout", "0"], "--refiner-timeout 0"),
    (["--gen-batch-size", "0"], "--gen-batch-size 0"),
    (["--eval-max-new-tokens", "0"], "--eval-max-new-tokens 0"),
    (["--tis-cap", "0.5"], "--tis-cap 0.5"),           # a cap below 1 scales every policy token down
    (["--tis-cap", "-1"], "--tis-cap -1"),
    (["--clip-eps", "0"], "--clip-eps 0"),
    (["--updates-per-batch", "0"], "--updates-per-batch 0"),
    (["--updates-per-batch", "9"], "--updates-per-batch 9"),   # the toy's 8 groups cannot make 9 mini-batches
])
def test_bad_flag_values_are_refused_before_anything_loads(flags, culprit, tmp_path, monkeypatch, capsys):
    """Regression: bad values were rejected only deep inside the run, or silently accepted."""
    line = refused(["--toy", *flags], tmp_path, monkeypatch, capsys)
    assert culprit in line, line


def test_no_clip_is_a_valid_setting():
    """docs/choices.md's way to run LUFFY's unclipped ratio, --clip-eps inf, passes the flag checks."""
    preflight.check_args(scope.parse_args(["--toy", "--clip-eps", "inf", "--updates-per-batch", "2"]))


def test_toy_only_flags_need_toy(tmp_path, monkeypatch, capsys):
    line = refused(["--toy-prm-noise", "0.2"], tmp_path, monkeypatch, capsys)
    assert "--toy-prm-noise" in line and "--toy" in line
    assert "--model toy" in refused(["--model", "toy", "--device", "cpu"], tmp_path, monkeypatch, capsys)


def test_args_built_in_code_are_checked_too(tmp_path, monkeypatch, capsys):
    """argparse checks choices on the command line; an Args built in code is checked as the same flags typed, and
    the refusal is raised to the caller (runs.Refused, a ValueError) in the Args' own names."""
    from harness.run.runs import Refused

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Refused, match="mode: invalid choice: 'nonsense'"):
        scope.main(scope.Args(toy=True, mode="nonsense"))


def test_empty_dataset_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    """Regression: `--dataset empty.jsonl` ran the whole evaluation, then numpy raised."""
    (tmp_path / "empty.jsonl").write_text("")
    line = refused(["--toy", "--dataset", str(tmp_path / "empty.jsonl")], tmp_path, monkeypatch, capsys)
    assert "--dataset" in line and "empty.jsonl" in line and "no problems" in line


def test_empty_eval_dataset_is_refused(tmp_path, monkeypatch, capsys):
    """Regression: an empty --eval-dataset ended in a traceback."""
    (tmp_path / "empty.jsonl").write_text("\n")
    line = refused(["--toy", "--eval-dataset", str(tmp_path / "empty.jsonl")], tmp_path, monkeypatch, capsys)
    assert "--eval-dataset" in line and "no problems" in line


def test_ordinary_questions_with_toy_are_refused(tmp_path, monkeypatch, capsys):
    """Regression: ordinary questions with --toy → `ValueError: not a toy question` from the toy PRM mid-run."""
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n")
    line = refused(["--toy", "--dataset", str(data)], tmp_path, monkeypatch, capsys)
    assert "not a toy question" in line and "problem 1" in line


def test_no_gpu_is_refused_before_the_data(tmp_path, monkeypatch, capsys):
    """Regression: the data loaded before the GPU check. A data set that cannot load must not be reached."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refused(["--dataset", str(tmp_path / "missing.jsonl")], tmp_path, monkeypatch, capsys)
    assert "no CUDA device" in line and "--device cpu" in line


def test_missing_local_model_path_is_named(tmp_path, monkeypatch, capsys):
    line = refused(["--model", str(tmp_path / "nope"), "--device", "cpu", "--mode", "grpo", "--prm", "none"],
                   tmp_path, monkeypatch, capsys)
    assert "nope" in line and "no such folder" in line


def test_resume_problems_are_one_line(tmp_path, monkeypatch, capsys):
    """Regression: `--resume` of a missing folder → FileNotFoundError; of an empty one → the same; of a folder with
    a foreign config → `TypeError: Args.__init__() got an unexpected keyword argument`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text(json.dumps({"learning_rate": 1e-5, "steps": 3}))
    for folder, words in (("missing", "no such folder"), ("empty", "no config.json"), ("foreign", "learning_rate")):
        with pytest.raises(SystemExit) as exc:
            scope.parse_args(["--resume", str(tmp_path / folder)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_memory_plan_hand_numbers():
    """Parameter counts from the published configs match the published sizes; KV bytes per token as
    2 · layers · kv_heads · head_dim · 2 bytes; the policy rows are 12 (all step) + 4 (update) bytes per
    parameter; the rollout engine is sized by need; the refiner's server counts its --refiner-mem share."""
    q15, q7 = memory.KNOWN_CONFIGS["Qwen2.5-1.5B"], memory.KNOWN_CONFIGS["Qwen2.5-7B"]
    assert memory.n_params(q15) == 1_543_714_304              # Qwen2.5-1.5B model card: 1.54 B
    assert memory.n_params(q7) == 7_615_616_512               # Qwen2.5-7B: 7.61 B
    assert memory.n_params(memory.KNOWN_CONFIGS["Qwen2.5-0.5B"]) == 494_032_768
    assert memory.kv_bytes_per_token(q15) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert memory.kv_bytes_per_token(q7) == 2 * 28 * 4 * 128 * 2 == 57_344
    args = scope.Args(model="Qwen2.5-1.5B", mode="grpo", prm="none", micro_batch_size=1, max_new_tokens=768)
    rows, _ = memory.memory_plan(args, gpu_gib=79.2, use_vllm=True)
    plan = {k: (v, ph) for k, v, ph in rows}
    policy = next(v for k, v in plan.items() if k.startswith("policy 1.54"))
    assert policy == (pytest.approx(12 * 1_543_714_304 / 2**30), "all")   # ≈ 17.3 GiB
    assert plan["policy gradients (fp32)"] == (pytest.approx(4 * 1_543_714_304 / 2**30), "update")
    engine = next(v for k, v in plan.items() if k.startswith("rollout engine"))
    # 16 x 8 sequences of 256 + 768 tokens at 28 KiB, plus bf16 weights; asleep during the update
    assert engine == (pytest.approx((2 * 1_543_714_304 + 128 * 1024 * 28_672) / 2**30), "other")
    # the context holds a prompt of up to 1024 tokens and the larger budget: --eval-max-new-tokens 3000
    assert memory.rollout_kv_need(args) == (128 * 1024 * 28_672, 1024 + 3000)
    full = scope.Args(model="Qwen2.5-1.5B")
    refiner = next(v for k, v, _ in memory.memory_plan(full, 79.2, True)[0] if k.startswith("refiner"))
    assert refiner == pytest.approx(0.25 * 79.2)
    # the peak is all-step rows + the larger phase
    assert memory.plan_total([("a", 1.0, "all"), ("b", 2.0, "update"), ("c", 3.0, "other")]) == 4.0


def test_memory_plan_targets_at_the_default_flags():
    """The default run fits 90 % of an 80 GB card as it reports (79.2 GiB) with the 7B PRM and refiner, and
    the GRPO baseline without PRM fits 40 GiB; the PRM goes to CPU memory on its own when needed."""
    full = scope.Args(model="Qwen2.5-1.5B")
    self_refine = scope.Args(model="Qwen2.5-1.5B", refiner="policy")
    assert not memory.prm_offloaded(self_refine, "cpu", True, gpu_gib=79.2)   # fits with the PRM resident
    assert memory.prm_offloaded(self_refine, "cpu", True, gpu_gib=47.5)       # only fits without it
    assert memory.plan_total(memory.memory_plan(self_refine, 47.5, True)[0]) <= 0.9 * 47.5
    total = memory.plan_total(memory.memory_plan(full, 79.2, True)[0])
    assert total <= 0.9 * 79.2, total
    grpo = scope.Args(model="Qwen2.5-1.5B", mode="grpo", prm="none")
    assert memory.plan_total(memory.memory_plan(grpo, 47.5, True)[0]) <= 40.0
    assert not memory.prm_offloaded(scope.Args(model="Qwen2.5-1.5B", refiner="policy", prm_offload="off"),
                                       "cpu", True, 47.5)


def test_memory_plan_per_process_under_torchrun(monkeypatch):
    """Under torchrun the plan is one process's: with --fsdp the policy's weights, AdamW state and gradients
    are divided by the world size, and the update adds FSDP2's traced terms (the root unit gathered in bf16 and
    reduce-scattered from fp32, bf16 activations: memory.FSDP_FIT); DDP adds its gradient buckets; the
    rollout engine's KV cache holds the rank's own groups. Guards the pre-flight refusing docs/scaling.md's
    `torchrun --nproc_per_node 8 scope.py --model Qwen2.5-Math-7B --fsdp` on 80 GB cards (the one-process plan,
    169.5 GiB, was applied to every rank), and the arithmetic FSDP2 rows the trace replaced (39.1 GiB for
    the update where FSDPMemTracker traces 23.11)."""
    p7 = 7_615_616_512
    fsdp = scope.Args(model="Qwen2.5-Math-7B", fsdp=True, prompts_per_step=64)
    rows, _ = memory.memory_plan(fsdp, 79.2, True, world=8)
    plan = {k: (v, ph) for k, v, ph in rows}
    assert next(v for k, v in plan.items() if k.startswith("policy 7.62")) == (pytest.approx(12 * p7 / 8 / 2**30), "all")
    assert next(v for k, v in plan.items() if k.startswith("policy gradients")) == (pytest.approx(4 * p7 / 8 / 2**30), "update")
    root = 152064 * 3584 * 2 + 3584                  # untied embeddings and lm_head, final norm
    gathered = next(v for k, v in plan.items() if k.startswith("FSDP2 root unit"))
    assert gathered == (pytest.approx(6 * root / 2**30), "update")   # bf16 gathered + fp32 reduce-scatter: 6.09 GiB
    activations = next(v for k, v in plan.items() if k.startswith("update activations"))
    assert activations == (pytest.approx(4 * 1280 * (2 * 3584 * 28 + 2.6 * 152064) / 2**30), "update")   # 2.84 GiB
    update = sum(v for k, (v, ph) in plan.items() if k.startswith(("policy", "FSDP2", "update")))
    assert update == pytest.approx(24_818_029_396 / 2**30, rel=0.01)   # FSDPMemTracker's peak of this rank: 23.11 GiB
    engine = next(v for k, v in plan.items() if k.startswith("rollout engine: vLLM bf16 weights + KV of 8x8"))
    assert engine[0] == pytest.approx((2 * p7 + 8 * 8 * 1280 * 57_344) / 2**30)   # 64 prompts / 8 ranks
    assert memory.plan_total(rows) <= 0.9 * 79.2
    assert memory.plan_total(memory.memory_plan(fsdp, 79.2, True, world=1)[0]) > 0.9 * 79.2
    monkeypatch.setenv("WORLD_SIZE", "8")   # as torchrun sets it: the pre-flight's own call sees the world
    assert memory.memory_plan(fsdp, 79.2, True) == (rows, [])
    ddp = scope.Args(model="Qwen2.5-1.5B", prompts_per_step=64)
    rows, _ = memory.memory_plan(ddp, 79.2, True)
    p15 = 1_543_714_304
    assert ("DDP gradient buckets (fp32, not traced)", pytest.approx(4 * p15 / 2**30), "all") in rows
    assert next(v for k, v, _ in rows if k.startswith("policy 1.54")) == pytest.approx(12 * p15 / 2**30)
    assert memory.rollout_kv_need(ddp) == (8 * 8 * 1280 * 28_672, 1024 + 3000)


def test_memory_plan_within_ten_percent_of_a_trace():
    """The plan's update rows (weights, AdamW, gradients, traced-constant activations) against a fresh
    FakeTensorMode + MemTracker trace of our own micro-batch step on a small Qwen2 shape that is not one
    of the fit's shapes, with and without gradient checkpointing."""
    from tools.bench.memory import SMALL, trace_update

    cfg = {**SMALL, "num_hidden_layers": 6, "vocab_size": 12288}
    for ckpt in (False, True):
        traced = trace_update(cfg, 2, 768, checkpointing=ckpt)["total"]
        planned = 16 * memory.n_params(cfg) + memory.update_extra_bytes(cfg, 2 * 768, ckpt)
        assert abs(planned / traced - 1) <= 0.10, (ckpt, planned / 2**20, traced / 2**20)


def test_a_24gb_card_plans_lora_and_the_trl_prm():
    """The plan of a LoRA policy: the bf16 base (2 bytes per parameter, all step), PEFT's adapters (r · (in + out) per
    linear layer: 18.46 M at rank 16 on Qwen2.5-1.5B's seven projections) with fp32 weights and AdamW state (12 B, all
    step) and gradients (4 B, update), no KL reference (the base with its adapters off). The TRL-trained 1.5B PRM's
    shape is known offline (a tied 1.5B backbone + a hidden→2 head) and is never served. docs/memory.md's 24 GB rows
    fit 90 % of the card, and a 24 GB card's "fits with" proposes them for the default command."""
    q15 = memory.KNOWN_CONFIGS["Qwen2.5-1.5B"]
    assert memory.lora_params(q15, 16) == 28 * 16 * (3072 + 1792 + 1792 + 3072 + 3 * (1536 + 8960)) == 18_464_768
    assert memory.lora_params(q15, 8, ("q_proj", "v_proj")) == 28 * 8 * (3072 + 1792)
    assert memory.n_params(memory.model_config(memory.TRL_PRM)) == 1_543_714_304 + 2 * 1536 + 2
    lora = scope.Args(model="Qwen2.5-1.5B", lora_rank=16, prm=memory.TRL_PRM, refiner="policy", kl_coef=0.1)
    rows, notes = memory.memory_plan(lora, 23.6, True)
    plan = {k: (v, ph) for k, v, ph in rows}
    assert plan["policy 1.54 B params: bf16 base weights, frozen (LoRA)"] == (pytest.approx(2 * 1_543_714_304 / 2**30), "all")
    assert plan["LoRA adapters 18.5 M params (rank 16): fp32 weights + AdamW m, v"] == (pytest.approx(12 * 18_464_768 / 2**30), "all")
    assert plan["LoRA adapter gradients (fp32)"] == (pytest.approx(4 * 18_464_768 / 2**30), "update")
    assert "KL reference (fp32)" not in plan and not notes   # no reference weights: the base with its adapters off
    assert plan[next(k for k in plan if k.startswith("KL reference's pass"))][1] == "update"   # but its logits
    assert not memory.prm_served(lora, True, 23.6) and any(k.startswith("PRM 1.54 B params (bf16)") for k in plan)
    full_05 = scope.Args(model="Qwen2.5-0.5B", prm=memory.TRL_PRM, refiner="policy")
    for args in (lora, full_05):
        assert memory.plan_total(memory.memory_plan(args, 23.6, True)[0]) <= 0.9 * 23.6
    lines = memory.format_plan(lora, *memory.memory_plan(lora, None, True), None).splitlines()
    assert any(line.strip().startswith("on a 24 GB GPU (23.6 GiB reported):") and line.endswith("fits") for line in lines)
    ways = memory.fixes(scope.Args(model="Qwen2.5-1.5B"), 23.6, True)
    assert f"--lora-rank 16 --prm {memory.TRL_PRM} --refiner policy" in ways, ways
    assert f"--prm {memory.TRL_PRM}" in memory.fixes(scope.Args(model="Qwen2.5-0.5B", refiner="policy"), 23.6, True)


def test_lora_plan_within_ten_percent_of_a_peft_trace():
    """The plan's LoRA update rows (bf16 base, fp32 adapters with gradients and AdamW state, LORA_UPDATE_FIT's
    activations) against a fresh FakeTensorMode + MemTracker trace of our micro-batch step on PEFT's get_peft_model
    of a small Qwen2 shape outside the fit (rank 8 on q and v only), with gradient checkpointing."""
    from tools.bench.memory import SMALL, trace_update

    cfg = {**SMALL, "num_hidden_layers": 6, "vocab_size": 12288}
    traced = trace_update(cfg, 2, 384, checkpointing=True, lora_rank=8, lora_targets=("q_proj", "v_proj"))["total"]
    planned = (2 * memory.n_params(cfg) + 16 * memory.lora_params(cfg, 8, ("q_proj", "v_proj"))
               + memory.lora_update_extra_bytes(cfg, 2 * 384, True))
    assert abs(planned / traced - 1) <= 0.10, (planned / 2**20, traced / 2**20)


def test_prm_plan_within_ten_percent_of_the_full_size_trace():
    """The plan's PRM rows (bf16 weights + scoring activations, PRM_FIT from small shapes) against a
    FakeTensorMode + MemTracker trace of our own Qwen2ProcessRewardModel (harness/engines/prm_checkpoint.py) at the real run's size:
    Qwen2.5-Math-PRM-7B scoring one micro-batch of 4 x 1,280 tokens (about 10 s of CPU: a forward without
    gradients), and the activations alone within 25 % (they are 5 % of the total)."""
    from tools.bench.memory import trace_prm

    cfg = memory.model_config("Qwen2.5-Math-PRM-7B")
    tokens = 4 * (memory.PROMPT_TOKENS + scope.Args().max_new_tokens)
    traced = trace_prm(cfg, 4, tokens // 4)
    planned_extra = memory.prm_scoring_bytes(cfg, tokens)
    planned = 2 * memory.n_params(cfg) + planned_extra
    assert abs(planned / traced["total"] - 1) <= 0.10, (planned / 2**30, traced["total"] / 2**30)
    assert abs(planned_extra / traced["activation"] - 1) <= 0.25, (planned_extra / 2**30, traced["activation"] / 2**30)


def test_the_memory_table_is_the_plan():
    """docs/memory.md's per-card table is what `python -m tools.bench.memory --table` prints from the plan (a
    change to the plan's constants or rows that leaves the page stale fails here), and its cells are the
    per-card lines of `--dry-run` (memory.format_plan) for the same flags."""
    from tools.bench.memory import TABLE_RUNS, memory_table

    table = memory_table()
    with open(os.path.join(ROOT, "docs", "memory.md"), encoding="utf-8") as f:
        assert table in f.read(), "docs/memory.md: regenerate the table with python -m tools.bench.memory --table"
    shown, flags = TABLE_RUNS[0]
    lines = memory.format_plan(scope.parse_args(flags.split()), *memory.memory_plan(
        scope.parse_args(flags.split()), None, True), None).splitlines()
    row = next(line for line in table.splitlines() if line.startswith(f"| {shown} |"))
    for (size, gib), cell in zip(memory.CARD_GIB.items(), row.split(" | ")[1:]):
        line = next(x for x in lines if x.strip().startswith(f"on a {size} GB GPU"))
        assert f": {cell.split(':')[0]} GiB, " in line and (("does not fit" in line) == ("no" in cell.split(";")[0]))


def test_a_gpu_too_small_stops_with_the_flags_that_fit(monkeypatch, capsys):
    """The run stops with the plan and the flags that would make it fit, instead of an OOM after loading."""
    import torch

    class Props:
        total_memory = 48 * 10**9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    args = scope.Args(model="Qwen2.5-1.5B")   # defaults: 7B PRM + 7B refiner + 1.5B policy, micro-batch 4
    with pytest.raises(SystemExit) as exc:
        preflight.check_memory(args, "cuda", use_vllm=True)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "memory plan" in captured.out and "peak" in captured.out
    line = captured.err.strip()
    assert "GiB" in line and "--refiner policy" in line, line
    gib = 48 * 10**9 / 2**30
    for way in line.split("fit with: ")[1].split(" | "):   # every suggestion really fits
        flags = way.split(" (")[0].split()
        change = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
        change = {k: type(getattr(args, k))(v) for k, v in change.items()}   # each flag's own type
        trial = scope.Args(**{**vars(args), **change})
        assert memory.plan_total(memory.memory_plan(trial, gib, True)[0]) <= 0.9 * gib
    small = scope.Args(model="Qwen2.5-0.5B", mode="grpo", prm="none", micro_batch_size=1)
    preflight.check_memory(small, "cuda", use_vllm=True)    # fits: printed, no stop


def test_dry_run_offline_prints_the_plan_and_exits(tmp_path):
    """`python scope.py --dry-run --model Qwen2.5-1.5B` without network or GPU: the plan, the Args, rc 0, no folder;
    and a real start without network: one line saying what to do, no screens of hub retries."""
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), "--dry-run", "--model", "Qwen2.5-1.5B"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "memory plan" in proc.stdout and "policy 1.54 B params" in proc.stdout
    assert "on a 80 GB GPU (79.2 GiB reported)" in proc.stdout and '"model": "Qwen2.5-1.5B"' in proc.stdout
    assert not (tmp_path / "runs").exists() and "Traceback" not in proc.stderr
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n")
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), "--model", "Qwen2.5-1.5B", "--device",
                           "cpu", "--dataset", str(data), "--eval-dataset", str(data)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.time() - t0 < 30 * pace()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no network" in errors[0] and "hf download Qwen/Qwen2.5-1.5B" in errors[0]
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_rejected_flag_from_the_command_line_is_fast(tmp_path):
    """The real entry point: exit 2, one line, seconds, no run folder."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), "--toy", "--group-size", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and time.time() - t0 < 20 * pace()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--group-size 0" in proc.stderr
    assert not (tmp_path / "runs").exists()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), "--resume", "runs/nope"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --resume runs/nope: no such folder", proc.stderr


def test_eval_report_goes_next_to_the_evaluated_run(tmp_path):
    """Regression: `eval.py --model runs/X/checkpoint` wrote eval_checkpoint.json into the working directory, so
    every run's evaluation overwrote the same file."""
    from harness.run.eval_cli import report_path

    for name in ("a", "b"):
        (tmp_path / "runs" / name / "checkpoint").mkdir(parents=True)
    a = report_path(str(tmp_path / "runs" / "a" / "checkpoint"))
    b = report_path(str(tmp_path / "runs" / "b" / "checkpoint") + "/")
    assert a == str(tmp_path / "runs" / "a" / "eval_checkpoint.json")
    assert b == str(tmp_path / "runs" / "b" / "eval_checkpoint.json")
    assert report_path("Qwen/Qwen2.5-Math-7B") == os.path.join("runs", "eval_Qwen_Qwen2.5-Math-7B.json")


def test_gitignore_has_no_mangled_lines():
    """Regression: .gitignore had its comment block pasted three times and `.pytest_# toy warm…` entries."""
    with open(os.path.join(ROOT, ".gitignore")) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    assert all(line.startswith("#") or "#" not in line for line in lines), lines
    assert len(lines) == len(set(lines)), "duplicated lines"
    assert ".pytest_cache/" in lines and "!cache/toy_warm_725d1cdb59cf/" in lines and "!cache/toy_refiner_3f9f426b1ba2/" in lines


def test_the_headline_total_is_for_the_card_it_names():
    """The dry-run's headline total (vLLM's weights + KV of every sequence) matched none of its per-card totals
    (30 % of each card): without a known card there is no headline total, only the per-card ones."""
    args = scope.Args(model="Qwen2.5-1.5B")
    rows, notes = memory.memory_plan(args, None, True)
    text = memory.format_plan(args, rows, notes, None)
    assert not any(line.strip().endswith("total") for line in text.splitlines())
    assert text.count("on a ") == len(memory.CARD_GIB) and "on a 80 GB GPU" in text
    rows, notes = memory.memory_plan(args, 80.0, True)
    totals = [line for line in memory.format_plan(args, rows, notes, 80.0).splitlines() if line.endswith("total")]
    assert totals == [f"  {memory.plan_total(rows):7.1f}  total"]
GIB = 2 ** 30
REFINER_7B = 2 * 7_615_616_512 / GIB + 64 * (256 + 1024) * 57_344 / GIB   # bf16 weights + KV of 64 x 1280 tokens


def test_refiner_fallback_refusal_by_the_memory_plan():
    """The refiner server failed: HF generate of the 7B refiner (weights 14.2 GiB + KV of one --gen-batch-size
    batch, 4.4 GiB, + 1 GiB) is allowed only when that much GPU memory is free; else one line with flags that fit."""
    args = scope.Args(model="Qwen2.5-1.5B")
    assert memory.refiner_gib(args, memory.model_config(args.refiner), 64) == pytest.approx(REFINER_7B)
    assert REFINER_7B == pytest.approx(18.56, abs=0.01)
    assert memory.refiner_fallback_refusal(args, 30.0, 80.0, "CUDA out of memory", "log") is None
    line = memory.refiner_fallback_refusal(args, 18.0, 80.0, "torch.OutOfMemoryError: CUDA out of memory", "x.log")
    assert "\n" not in line and "lack of GPU memory" in line and "x.log" in line and "about 20 GiB" in line
    # (18 - 0.5) / 80 = 0.21875 -> 0.21, above (14.2 + 2) / 80 = 0.20: a share that the free memory holds
    assert line.endswith("fits with: --refiner-mem 0.21 | --refiner-url http://HOST:8000/v1 (vllm serve the "
                         "refiner elsewhere) | --refiner policy"), line
    line = memory.refiner_fallback_refusal(args, 10.0, 80.0, "exit code 1", "x.log")
    assert "fits with: --refiner-url" in line and "(see its log)" in line   # 10 GiB cannot hold the weights


def test_a_refiner_server_that_fails_for_memory_stops_instead_of_loading_7b(monkeypatch, tmp_path, capsys):
    """Regression: a refiner `vllm serve` that failed to start (e.g. for lack of memory) was followed by a silent
    HF load of the 7B refiner onto the trainer's GPU. Now: on a GPU without room, one line and exit 2 before
    any load; on the CPU the HF fallback stays, with --gen-batch-size sequences per generate call."""
    import torch

    from harness.engines import generate
    from harness.run import wiring

    def fail(*a, **kw):
        raise RuntimeError("the server exited during start-up (exit code 1); last lines:\nCUDA out of memory")

    loaded = []
    monkeypatch.setattr(wiring, "vllm_importable", lambda: True)
    monkeypatch.setattr(wiring, "load_tokenizer", lambda name: object())
    monkeypatch.setattr(generate, "serve_with_vllm", fail)
    monkeypatch.setattr(wiring, "load_causal_lm", lambda name, device: loaded.append(name) or (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(wiring, "HFGenerator", lambda model, tok, batch: ("hf", batch))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    args = scope.Args(model="Qwen2.5-1.5B", gen_batch_size=48)
    with pytest.raises(SystemExit) as exc:
        wiring.load_refiner(args, None, None, "cuda:0", str(tmp_path), scope.refine.refiner_prompt)
    assert exc.value.code == 2 and loaded == []
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert "--refiner policy" in err[0] and "refiner_server.log" in err[0], err   # the refusal, then the log's tail
    assert err[1:3] == ["the server exited during start-up (exit code 1); last lines:", "CUDA out of memory"], err
    assert len(err) == 4 and err[3].startswith("hint: ") and "memory" in err[3], err   # the hint that fits the log
    refiner = wiring.load_refiner(args, None, None, "cpu", str(tmp_path), scope.refine.refiner_prompt)   # the CPU: HF generate is safe
    assert loaded == [args.refiner] and refiner.generator == ("hf", 48)


def test_grpo_mode_loads_no_prm_unless_one_is_named(monkeypatch):
    """Guards the unfair baseline: `--mode grpo` loaded the 7B PRM (13 GiB, ~3 s a step) for its near-miss metrics
    alone unless --prm none was typed. Now a GRPO run off the toy world resolves to --prm none and wiring.load_prm
    loads nothing; a PRM typed by name is kept, and the other modes keep the default PRM."""
    from harness.run import wiring

    grpo_args = scope.parse_args(["--model", "Qwen2.5-1.5B", "--mode", "grpo"])
    assert grpo_args.prm == "none"
    assert wiring.load_prm(grpo_args, "cpu", lambda *a, **k: pytest.fail("loaded a PRM for --mode grpo")) is None
    named = scope.parse_args(["--mode", "grpo", "--prm", "Qwen/Qwen2.5-Math-PRM-7B"])
    assert named.prm == "Qwen/Qwen2.5-Math-PRM-7B"                    # asked for by name: kept
    for mode in ("scope", "replace", "prm-reward"):
        assert scope.parse_args(["--mode", mode]).prm == "Qwen/Qwen2.5-Math-PRM-7B"
    assert scope.parse_args(["--toy", "--mode", "grpo"]).prm == "toy"   # the toy PRM costs nothing


def test_the_update_autocasts_each_forward_only_as_the_memory_plan_was_traced():
    """Guards the plan fitted to another layout than the run's: the update step wrapped the whole update (every
    micro-batch, backward, clipping, AdamW.step) in one autocast region, so autocast's bf16 copies of the fp32
    weights lived through the step, while tools/bench/memory.py traces autocast around each micro-batch's
    forward and loss. scope.main's step 7 through a Run whose amp() is a real (CPU) bf16 autocast: the model's forwards
    run under autocast, backward and AdamW.step outside it."""
    from types import SimpleNamespace

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo import build_batch, update
    from harness.run import wiring
    from refine import Trajectory

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    seen = {"forward": [], "backward": [], "step": []}
    model.register_forward_hook(lambda *_: seen["forward"].append(torch.is_autocast_enabled("cpu")))
    model.lm_head.weight.register_hook(lambda g: seen["backward"].append(torch.is_autocast_enabled("cpu")))

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            seen["step"].append(torch.is_autocast_enabled("cpu"))
            return super().step(closure)

    class AutocastRun(wiring.Run):
        def amp(self):
            return torch.autocast("cpu", dtype=torch.bfloat16)

    args = scope.Args(micro_batch_size=2, max_new_tokens=4, rollout_sleep=False)
    run = AutocastRun(args, "", "cpu", False, model, SimpleNamespace(pad_token_id=0, eos_token_id=0), None, None,
                      None, None, Recording(model.parameters(), lr=1e-3), [], [], 1, None, None, 0.0, model=model)
    trajs = [Trajectory("q", "1", g, [1, 2, 3], [4 + g, 5, 6], "", reward=float(g % 2)) for g in range(4)]
    batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                        [t.offpolicy_mask for t in trajs], torch.tensor([0.5, -0.5, 0.5, -0.5]), run.pad_id)
    with run.update_phase():   # as scope.main runs step 7
        stats = update(run.model, run.optimizer, run.on_device(batch), [t.group for t in trajs],
                       **run.update_engine(), updates_per_batch=args.updates_per_batch,
                       max_new_tokens=args.max_new_tokens)
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    # --updates-per-batch 2 (the real default): the π_old pass over the second mini-batch (one micro-batch of 2
    # rows), then one optimizer step per mini-batch of 2 groups (one micro-batch each): every forward under autocast
    assert seen["forward"] == [True] * 3
    assert seen["backward"] and not any(seen["backward"])  # backward outside the region
    assert seen["step"] == [False, False]                  # AdamW.step outside it: the bf16 copies are gone


@pytest.mark.slow
def test_fsdp_plan_within_ten_percent_of_an_fsdp_mem_tracker_trace():
    """The plan's FSDP2 update terms (memory.FSDP_FIT) against a fresh FSDPMemTracker trace of one rank of 8
    on a fake process group (tools/bench/memory.py trace_fsdp_update, in its own process: the fake group cannot
    be left), at a shape outside the fit: Qwen2.5-Math-7B's width with 4 layers, 2 x 640 tokens (traced 9.86
    GiB, planned 10.36 when written)."""
    code = (f"import sys; sys.path.insert(0, {ROOT!r})\n"
            "from tools.bench.memory import trace_fsdp_update\n"
            "from harness.plan import memory\n"
            "cfg = dict(memory.model_config('Qwen2.5-Math-7B'), num_hidden_layers=4)\n"
            "peak = trace_fsdp_update(cfg, 8, 2, 640, checkpointing=True)['total']\n"
            "root, activations = memory.fsdp_update_bytes(cfg, 2 * 640)\n"
            "print('FIGURES', peak, 16 * memory.n_params(cfg) / 8 + root + activations)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    traced, planned = (float(x) for x in proc.stdout.split("FIGURES")[1].split())
    assert traced > 8 * 2**30                                  # the shards and the gathered root are there
    assert abs(planned / traced - 1) <= 0.10, (traced / 2**30, planned / 2**30)


def test_a_run_from_before_updates_per_batch_resumes_without_a_change(tmp_path):
    """Regression: the resume check compares the run's settings with the resumed Args; both must read the missing
    key as the run had it (1), else every old run is refused as changing --updates-per-batch."""
    from dataclasses import asdict

    import scope

    config = asdict(scope.Args())
    config.pop("updates_per_batch")
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = scope.parse_args(["--resume", str(tmp_path)])
    assert preflight.resume_changes(args, str(tmp_path)) == {}


def test_a_run_from_before_updates_per_batch_resumes_with_one_step_per_batch(tmp_path):
    """Regression: a config.json written before --updates-per-batch existed has no such key; those runs made one
    optimizer step per rollout batch, so their resume must too (not the real run's new default of 2)."""
    from dataclasses import asdict

    import scope

    config = asdict(scope.Args())
    config.pop("updates_per_batch")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert scope.Args().updates_per_batch == 2
    assert scope.parse_args(["--resume", str(tmp_path)]).updates_per_batch == 1
    config["updates_per_batch"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert scope.parse_args(["--resume", str(tmp_path)]).updates_per_batch == 3


def test_a_cpu_run_of_a_real_model_prints_no_gpu_memory_plan(capsys):
    """A CPU run from a local folder printed a GPU memory plan, which says nothing about the CPU."""
    import scope

    args = scope.parse_args(["--model", "some/model", "--device", "cpu", "--backend", "hf"])
    preflight.check_memory(args, "cpu", False)
    assert capsys.readouterr().out == ("memory: a real model on the CPU (--device cpu); no GPU memory plan "
                                       "(--dry-run prints it)\n")
    preflight.check_memory(scope.parse_args(["--model", "some/model", "--dry-run"]), "cpu", False)
    assert "memory plan" in capsys.readouterr().out


def test_vllms_own_buffers_the_kl_reference_and_hf_evaluation_are_planned():
    """Regression: the plan left out vLLM's own runtime buffers (sampler logits, output_bin_counts, graph pool,
    prefill step: vLLM 0.33's defaults would size them for 1,024 sequences and 16,384 tokens on an H100), the KL
    reference's logits (--kl-coef > 0; a LoRA plan said the reference costs nothing) and HF evaluation's KV cache
    (64 rows of up to --eval-max-new-tokens, sized by --max-new-tokens). The engine gets the limits its rows assume,
    and the 80 GB default and the 24 GB LoRA row still fit."""
    q15 = memory.KNOWN_CONFIGS["Qwen2.5-1.5B"]
    default = scope.Args(model="Qwen2.5-1.5B")
    assert memory.rollout_engine_limits(default, 1) == (128, 8192)
    assert memory.rollout_engine_limits(scope.Args(model="Qwen2.5-1.5B", prompts_per_step=64), 8) == (64, 8192)
    held, generating = memory.vllm_runtime_bytes(q15, 128, 8192)
    assert held == memory.prm_scoring_bytes(q15, 256)   # the graph pool: decode graphs of up to 2 x 128 tokens
    assert generating == (4 + 6) * 128 * 151936 + memory.prm_scoring_bytes(q15, 8192)   # bin counts, logits
    assert sum(memory.vllm_runtime_bytes(q15, 1024, 16384)) > 3 * (held + generating)   # vLLM's H100 defaults
    rows = memory.memory_plan(default, 79.2, True)[0]
    runtime = {ph: gib for name, gib, ph in rows if name.startswith("vLLM runtime (not traced)")}
    assert runtime == {"all": pytest.approx(held / 2**30), "other": pytest.approx(generating / 2**30)}   # sleeps
    assert not any(name.startswith("vLLM runtime") for name, _, _ in memory.memory_plan(
        scope.Args(model="Qwen2.5-1.5B", backend="hf"), 79.2, False)[0])
    assert memory.plan_total(rows) <= memory.FIT_SHARE * 79.2
    lora = scope.Args(model="Qwen2.5-1.5B", lora_rank=16, prm=memory.TRL_PRM, refiner="policy")
    assert memory.plan_total(memory.memory_plan(lora, 23.6, True)[0]) <= memory.FIT_SHARE * 23.6

    def plan(**kw):   # {row: (GiB, phase)}
        return {n: (g, ph) for n, g, ph in memory.memory_plan(scope.Args(model="Qwen2.5-1.5B", **kw), 79.2,
                                                                  kw.get("backend") != "hf")[0]}

    def total(**kw):
        return memory.plan_total([(n, g, ph) for n, (g, ph) in plan(**kw).items()])
    reference_pass = (2 * 4 * 1280 + 8 * 512) * 151936 / 2**30   # bf16 logits of 4 x 1,280 tokens, a float32 chunk
    for kw, weights in ((dict(mode="grpo", prm="none"), 4 * memory.n_params(q15) / 2**30),
                        (dict(lora_rank=16, prm=memory.TRL_PRM, refiner="policy"), None)):   # LoRA: the base
        added = {n: v for n, v in plan(kl_coef=0.05, **kw).items() if n not in plan(**kw)}
        assert added.pop("KL reference (fp32)", (None,))[0] == (weights and pytest.approx(weights))
        (name, (gib, phase)), = added.items()
        assert name.startswith("KL reference's pass") and gib == pytest.approx(reference_pass) and phase == "update"
        assert total(kl_coef=0.05, **kw) >= total(**kw) + (weights or 0) - 1e-9   # LoRA: the update may not be the peak
    kv = 28 * 2 * 2 * 128 * 2   # Qwen2.5-1.5B's KV bytes per token
    hf = dict(backend="hf", prm="none", mode="grpo")
    def hf_kv(**kw):
        return next(g for n, (g, ph) in plan(**hf, **kw).items() if n.startswith("rollout KV cache (HF generate"))
    assert hf_kv() == pytest.approx(64 * (256 + 3000) * kv / 2**30)   # the evaluation's 3,000 tokens, not 1,024
    assert hf_kv(eval_max_new_tokens=6000) - hf_kv() == pytest.approx(64 * 3000 * kv / 2**30)
    assert hf_kv(eval_max_new_tokens=6000, eval_every=0) == pytest.approx(64 * (256 + 1024) * kv / 2**30)
    assert total(eval_max_new_tokens=6000, **hf) > total(**hf)
