"""served_prm.py — the process reward model on vLLM's pooling runner, served like the refiner.

Qwen2.5-Math-PRM-7B (`Qwen2ForProcessRewardModel`) is a native vLLM pooling model: `vllm serve PRM --runner pooling`
loads it in bf16, and `POST /pooling` with `"task": "token_classify"` returns, for each input, the softmax over its
2 classes at every position holding the step tag (STEP pooling on `step_tag_id`, the `<extra_0>` id of the PRM's
tokenizer, passed with `--pooler-config`). The trainer builds the inputs exactly as for the in-process PRM (the
qwen-math-prm family's layout, harness/engines/prm_families.py: token ids, so the separators arrive intact) and reads
P(correct) = class 1 at each separator. What the server adds over HF in the trainer: paged attention without
padding, CUDA graphs, and the PRM's weights outside the trainer (no offload to CPU memory around the update);
docs/vllm.md.

    prm = ProcessRewardModel(path, served=serve_prm(path, sep_id=..., log_path=..., gpu_memory_utilization=0.2))

`PooledStepScores` stands in for the PRM's module inside prm_engine.PRMEngine.probs_at (under ProcessRewardModel.score_batch): called like it with a
padded (b, T) batch, it sends the unpadded rows in ONE request and returns (b, T, 2) log-probabilities, equal to
log(vLLM's probabilities) at the separators and 0 elsewhere (score_batch's softmax gives vLLM's probabilities back;
the other positions are never read). Every request and reply is held against vLLM 0.33's own protocol classes by
tests/test_vllm33_contract.py; the step probabilities equal the HF path's on the toy-sized model in the vLLM stage
(tests/test_vllm.py).
"""
import json

import torch

POOLING_TASK = "token_classify"  # vLLM 0.33's task of a per-token classifier (vllm/tasks.py)


def pooling_body(model: str, inputs: list[list[int]]) -> dict:
    """The POST /pooling body for token-id inputs: no special tokens added, the model's own activation (softmax),
    plain floats back."""
    return {"model": model, "input": [list(map(int, ids)) for ids in inputs], "task": POOLING_TASK,
            "add_special_tokens": False, "use_activation": True, "encoding_format": "float"}


def step_rows(reply, inputs: list[list[int]], sep_id: int, url: str = "") -> list[list[list[float]]]:
    """Per input, its [P(wrong), P(correct)] rows, one per separator in order; a reply of another shape (a
    different count of inputs or of separators, not 2 classes, not probabilities) is one RuntimeError naming it."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list) or len(data) != len(inputs):
        got = len(data) if isinstance(data, list) else "no"
        raise RuntimeError(f"the PRM server {url} (/pooling) returned {got} results for {len(inputs)} inputs")
    out = []
    for k, item in enumerate(sorted(data, key=lambda d: d.get("index", 0))):
        rows, want = item.get("data"), inputs[k].count(sep_id)
        if not isinstance(rows, list) or len(rows) != want or any(
                not isinstance(r, list) or len(r) != 2 for r in rows):
            raise RuntimeError(f"the PRM server {url} (/pooling): input {k} has {want} separators (id {sep_id}) but "
                               f"the reply holds {_shape(rows)}; is the server started with --runner pooling and "
                               "this step_tag_id?")
        if any(abs(sum(r) - 1) > 1e-3 or min(r) < 0 for r in rows):
            raise RuntimeError(f"the PRM server {url} (/pooling): input {k}'s rows are not probabilities "
                               "(softmax activation off?)")
        out.append(rows)
    return out


def _shape(rows) -> str:
    if not isinstance(rows, list):
        return type(rows).__name__
    return f"{len(rows)} rows of {sorted({len(r) if isinstance(r, list) else -1 for r in rows})} values"


class PooledStepScores:
    """The served PRM's forward for prm.ProcessRewardModel (module docstring). `client` is any object with
    `_request(path, body)` (generate.OpenAIGenerator's retrying JSON request, with its timeouts and its
    GeneratorUnavailable when the server is gone)."""

    def __init__(self, client, model: str, sep_id: int):
        self.client, self.model, self.sep_id = client, model, sep_id
        self.requests = 0

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), mask.cpu())]  # right-padded: the prefix
        reply = self.client._request("/pooling", pooling_body(self.model, rows))
        self.requests += 1
        probs = step_rows(reply, rows, self.sep_id, getattr(self.client, "url", ""))
        out = torch.zeros(*input_ids.shape, 2)  # (b, T, 2) log-probabilities at the separators, 0 elsewhere
        for b, (ids, p) in enumerate(zip(rows, probs)):
            where = [t for t, token in enumerate(ids) if token == self.sep_id]
            if where:
                out[b, where] = torch.tensor(p, dtype=torch.float32).clamp_min(1e-30).log()
        return out

    # ProcessRewardModel and the run call these on an in-process module; a served one has nothing to move
    def eval(self):
        return self

    def to(self, *args, **kwargs):
        return self


def serve_command_extra(sep_id: int, kv_cache_bytes: int, dtype: str = "bfloat16", quantization: str = "none",
                        batched_tokens: int | None = None) -> list[str]:
    """`vllm serve` flags of the PRM beyond the refiner's: the pooling runner, STEP pooling on the separator id,
    the dtype (bf16 on a GPU), a KV cache sized by need, the tokens of one prefill step that the plan's activations
    assume (`batched_tokens`: memory.prm_batched_tokens; None: vLLM's default), and --prm-quantization
    (`prm_quantization_flags`)."""
    budget = ["--max-num-batched-tokens", str(int(batched_tokens))] if batched_tokens else []
    return ["--runner", "pooling", "--pooler-config", json.dumps({"step_tag_id": int(sep_id)}), "--dtype", dtype,
            "--kv-cache-memory-bytes", str(int(kv_cache_bytes)), *budget, *prm_quantization_flags(quantization)]


# vLLM 0.33's --quantization fp8 quantizes every LinearBase, the score head's too, whose float32 bias then meets a
# bf16 output in the CUTLASS FP8 GEMM (an assertion at start-up). Its online quantization takes per-layer targets
# (config/quantization.py: QuantizationConfigArgs.targets, fnmatch patterns on each layer's module name; a layer
# matching none stays as it is): the decoder layers' projections (qkv_proj, o_proj, gate_up_proj, down_proj) in FP8
# with a per-tensor weight scale (the method --quantization fp8 picks for a bf16 checkpoint). Nothing else matches:
# not each layer's attention (`model.layers.N.self_attn.attn`, whose KV cache would ask the same config for a method
# and stop the start: online quantization does not support Attention), not the embeddings, not the score head
# (built with no module name). Checked on vLLM 0.33.0 (tests/test_vllm33_contract.py).
PRM_FP8_TARGETS = {"model.layers.*_proj": "fp8_per_tensor"}


def prm_quantization_flags(quantization: str) -> list[str]:
    """`vllm serve` flags of --prm-quantization: none = the checkpoint's dtype; fp8 = FP8 decoder layers only."""
    if quantization == "none":
        return []
    if quantization != "fp8":
        raise ValueError(f"--prm-quantization: none or fp8, got {quantization!r}")
    return ["--quantization", "online", "--quantization-config", json.dumps({"targets": PRM_FP8_TARGETS})]


def serve_prm(model: str, tokenizer, *, sep_id: int, log_path: str, gpu_memory_utilization: float,
              kv_cache_bytes: int, max_model_len: int, cpu: bool = False, dtype: str = "bfloat16",
              quantization: str = "none", timeout: float = 600, retries: int = 2,
              startup_timeout: float = 900, batched_tokens: int | None = None) -> PooledStepScores:
    """Start `vllm serve model --runner pooling` on a free local port (generate.serve_with_vllm: its log, its
    process-group handling, closed at exit) and return the stand-in module that queries it. RuntimeError when it
    cannot start."""
    from harness.engines.generate import serve_with_vllm

    served = serve_with_vllm(model, tokenizer, log_path=log_path, gpu_memory_utilization=gpu_memory_utilization,
                             cpu=cpu, timeout=timeout, retries=retries, startup_timeout=startup_timeout,
                             max_model_len=max_model_len,
                             extra=serve_command_extra(sep_id, kv_cache_bytes, dtype, quantization, batched_tokens))
    scores = PooledStepScores(served, served.model, sep_id)
    scores.server = served.server
    return scores


def start_for_run(args, run_dir: str, separator: str, kv_bytes: int, gib: float,
                  batched_tokens: int) -> PooledStepScores:
    """scope.py's served PRM (harness/run/wiring.load_prm, when memory.prm_served): `vllm serve args.prm` on this
    process's GPU with the memory share and KV cache the caller's plan gives (`kv_bytes` of KV cache, `gib` in all,
    `batched_tokens` per prefill step: the memory plan's prm_server_need and prm_batched_tokens), logging to
    run_dir/prm_server.log (one per rank under torchrun); `separator` is the step tag whose id STEP pooling reads."""
    import os

    from harness.engines.generate import load_tokenizer

    tokenizer = load_tokenizer(args.prm)
    sep_id = tokenizer.convert_tokens_to_ids(separator)
    if sep_id is None or sep_id == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer of PRM {args.prm!r} has no {separator!r} token")
    total_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
    rank = f".rank{os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    log_path = os.path.join(run_dir, f"prm_server{rank}.log")
    print(f"starting the PRM server (vllm serve {args.prm} --runner pooling); log: {log_path}")
    return serve_prm(args.prm, tokenizer, sep_id=sep_id, log_path=log_path, kv_cache_bytes=kv_bytes,
                     gpu_memory_utilization=round(min(gib / total_gib, 0.95), 3), max_model_len=None,
                     quantization=args.prm_quantization, timeout=getattr(args, "refiner_timeout", 600),
                     batched_tokens=batched_tokens)
