"""scope.py end to end: subprocess smoke runs of the real entry point with tiny settings (CPU, seconds each).

- every --mode runs 2 steps in the toy world and writes metrics with all the required fields;
- resume: 2 steps + resume for 1 gives the same step-3 metrics as 3 uninterrupted steps;
- a dataset file with a bad row stops the run with an error naming the row;
- the real path (HF backend, CPU): tiny random Qwen2 + BPE tokenizer on disk, PRM = tiny random token
  classifier, refiner = the policy itself;
- argument precedence (typed flag > resumed config > --toy defaults > dataclass defaults).
The toy policy here is a tiny warm start (a few SFT steps) built once per session, not the demo's.
"""
import json
import os
import sys

import pytest

from conftest import run_scope

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REQUIRED = ["step", "mode", "reward_mean", "frac_all_fail", "frac_all_pass", "rectify_tried", "rectify_accepted",
            "keep_ratio_steps", "keep_ratio_tokens", "near_miss_frac", "discarded_valid_frac", "entropy",
            "response_len", "loss", "grad_norm", "skipped", "time_rollout", "time_prm", "time_refine",
            "time_update", "time_sync", "time_step"]
TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "96",
        "--micro-batch-size", "4", "--eval-size", "4", "--save-every", "100"]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [("scope", []), ("grpo", []), ("replace", ["--merge", "append"]),
                                         ("prm-reward", [])])
def test_each_mode_runs_two_toy_steps(tmp_path, toy_model_dir, mode, extra):
    run_scope(["--toy", "--model", toy_model_dir, "--mode", mode, "--run-name", "r", "--eval-every", "2",
               *TINY, *extra], cwd=tmp_path)
    run = tmp_path / "runs" / "r"
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]          # step 0 = the evaluation before training
    assert "eval_acc" in rows[0] and "eval_acc" in rows[2]
    for row in rows[1:]:
        assert set(REQUIRED) <= set(row), set(REQUIRED) - set(row)
        assert row["mode"] == mode
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["skipped"] == 0.0
    config = json.loads((run / "config.json").read_text())
    assert config["mode"] == mode and config["toy"] is True and config["prompts_per_step"] == 2
    traces = read_jsonl(run / "traces.jsonl") if (run / "traces.jsonl").exists() else []
    assert len(traces) == sum(r["rectify_tried"] for r in rows[1:])
    if mode in ("grpo", "prm-reward"):
        assert traces == []
    for tr in traces:
        assert {"step", "group", "question", "steps", "scores", "cut", "accepted", "suffixes"} <= set(tr)
        if mode == "replace":
            assert tr["mode"] == "replace" and tr["prefix_text"] == ""
    if mode == "replace":   # regression: the PRM's κ of the pick was logged although nothing is kept
        assert all(r["keep_ratio_steps"] in (None, 0.0) and r["keep_ratio_tokens"] in (None, 0.0) for r in rows[1:])
    assert (run / "checkpoint" / "optimizer.pt").exists() and (run / "checkpoint" / "state.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--use_peft", "--lora_r", "4"]], ids=["full", "lora"])
def test_resume_reproduces_the_next_step(tmp_path, toy_model_dir, lora):
    """Guards against resume drift: a resumed run must not redraw prompts or samples differently (every
    random draw derives from (seed, step)) nor lose optimizer state; with LoRA, nor lose the adapter."""
    common = ["--toy", "--model", toy_model_dir, "--eval-every", "0", "--toy-prm-noise", "0.2", *TINY, *lora]
    run_scope([*common, "--steps", "3", "--run-name", "full"], cwd=tmp_path)
    run_scope([*common, "--steps", "2", "--run-name", "part"], cwd=tmp_path)
    run_scope(["--resume", "runs/part", "--steps", "3"], cwd=tmp_path)
    full = read_jsonl(tmp_path / "runs" / "full" / "metrics.jsonl")
    part = read_jsonl(tmp_path / "runs" / "part" / "metrics.jsonl")
    assert [r["step"] for r in part] == [1, 2, 3]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("time_")}  # noqa: E731
    assert strip(part[2]) == strip(full[2])
    assert strip(part[1]) == strip(full[1])


def test_bad_dataset_row_is_named(tmp_path, toy_model_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "Start at 3, add 4.", "answer": "7"}) + "\n"
                    + json.dumps({"question": "Start at 5, add 1."}) + "\n")
    proc = run_scope(["--toy", "--model", toy_model_dir, "--dataset", str(data), *TINY], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stderr and "2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_gives_one_clear_error(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n")
    proc = run_scope(["--model", str(tmp_path / "no-such-model"), "--dataset", str(data), "--eval-dataset", str(data),
                      "--device", "cpu", "--mode", "grpo", "--prm", "none", *TINY], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "no-such-model" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_real_path_on_cpu_with_self_refinement(tmp_path, tiny_prm_dir):
    from conftest import make_bpe_tokenizer, make_tiny_causal_lm

    tok = make_bpe_tokenizer()
    policy_dir = tmp_path / "tiny-policy"
    make_tiny_causal_lm(tok).save_pretrained(policy_dir)
    tok.save_pretrained(policy_dir)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                            for a in range(1, 5)))
    proc = run_scope(["--model", str(policy_dir), "--prm", tiny_prm_dir, "--refiner", "policy", "--device", "cpu",
                      "--backend", "hf", "--dataset", str(data), "--eval-dataset", str(data), "--eval-every", "2",
                      "--run-name", "real", *TINY], cwd=tmp_path)
    assert "no GPU" in proc.stderr          # says clearly that this will be slow
    rows = read_jsonl(tmp_path / "runs" / "real" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert set(REQUIRED) <= set(row)
    assert os.path.exists(tmp_path / "runs" / "real" / "checkpoint" / "model.safetensors")
    proc = run_scope(["--model", str(policy_dir), "--prm", str(tmp_path / "no-such-prm"), "--device", "cpu",
                      "--dataset", str(data), "--eval-dataset", str(data), *TINY], cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "no-such-prm" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_argument_precedence(tmp_path):
    import scope
    from harness.run.config import TOY_DEFAULTS

    assert scope.parse_args([]).mode == "scope" and scope.parse_args([]).lr == 1e-6
    toy_args = scope.parse_args(["--toy"])
    assert toy_args.steps == TOY_DEFAULTS["steps"] and toy_args.model == "toy"
    assert scope.parse_args(["--toy", "--steps", "7"]).steps == 7        # a typed flag beats a toy default
    assert scope.parse_args(["--toy", "--steps", str(TOY_DEFAULTS["steps"])]).steps == TOY_DEFAULTS["steps"]
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**vars(toy_args), "steps": 5, "seed": 3}))
    resumed = scope.parse_args(["--resume", str(run), "--steps", "9"])
    assert (resumed.steps, resumed.seed, resumed.toy, resumed.resume) == (9, 3, True, str(run))
    with pytest.raises(SystemExit):
        scope.parse_args(["--mode", "nonsense"])


def test_saved_toy_tokenizer_keeps_its_spaces(toy_model_dir):
    """Guards the bug where AutoTokenizer (transformers 5.20) turned a folder holding a qwen2 config.json and
    the toy char tokenizer into a Qwen2Tokenizer that dropped every space: the policy then saw
    "Question:Startat5,..." and the toy run never learnt. generate.load_tokenizer keeps the saved pipeline;
    scope.py, eval.py (the CLI on a toy checkpoint), experiment.py and prm.py all load through it."""
    from harness.engines import generate
    from harness.data import toy

    text = "Question: Start at 5, add 3.\nSolution:\nSo 5 + 3 = 8.\n\n\\boxed{8}"
    want = toy.make_tokenizer().encode(text, add_special_tokens=False)
    for tok in (generate.load_tokenizer(toy_model_dir), generate.load_causal_lm(toy_model_dir, "cpu")[1]):
        assert tok.encode(text, add_special_tokens=False) == want
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
