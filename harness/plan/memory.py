"""memory.py — the GPU memory a step will need, planned before anything loads (the pre-flight prints it and stops a
run that cannot fit; `--dry-run` prints it per card size).

`memory_plan`: weights, gradients and AdamW state of the float32 policy (or a LoRA adapter over a bf16 base), the
rollout engine sized by need, the PRM, the refiner's server share, the update's activations and temporaries, by
phase of the step, for one process (under torchrun: what FSDP2 shards divided by the world size), from the model
configs (a local folder, the hub cache, or the known sizes of the aliases below) and constants traced from our own
code (`python -m tools.bench.memory`). `fixes` lists the flags that would make a plan fit; `format_plan` prints it.
The plan is traced on the CPU's kernels and checked per phase on a GPU by phase_memory.py (docs/memory.md).
"""
import json
import os

from harness.engines import lora, prm_families
from harness.engines.refiner import MODES_WITH_REFINER

MODES_WITH_PRM = MODES_WITH_REFINER + ("prm-reward",)   # the modes that load a PRM

GIB = 2 ** 30
MODEL_ALIASES = {name: f"Qwen/{name}" for name in (
    "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen2.5-7B", "Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen2.5-32B-Instruct", "Qwen2.5-Math-1.5B", "Qwen2.5-Math-7B",
    "Qwen2.5-Math-1.5B-Instruct", "Qwen2.5-Math-7B-Instruct", "Qwen2.5-Math-PRM-7B")}
PROMPT_TOKENS = 256       # assumed prompt length (system prompt + a MATH question) for the plan

# The published config.json fields the plan needs, for the aliases (so --dry-run works offline).
_QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True)
_QWEN_7B = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)
KNOWN_CONFIGS = {
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "Qwen2.5-1.5B": _QWEN_1_5B, "Qwen2.5-Math-1.5B": _QWEN_1_5B,
    "Qwen2.5-3B": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
    "Qwen2.5-7B": _QWEN_7B, "Qwen2.5-Math-7B": _QWEN_7B,
    "Qwen2.5-32B": dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, intermediate_size=27648, tie_word_embeddings=False),
    "Qwen2.5-Math-PRM-7B": {**_QWEN_7B, "head": "prm"},   # the 7B backbone + a 2-layer scoring head, no LM head
    # HuggingFaceH4's: Qwen2.5-Math-1.5B-Instruct trained with TRL's PRMTrainer, Qwen2ForTokenClassification
    "Qwen2.5-Math-1.5B-Instruct-PRM-0.2": {**_QWEN_1_5B, "head": "token-classification"},
}
TRL_PRM = "HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2"   # the 1.5B PRM a 24 GB card holds beside the policy


def model_config(name: str) -> dict | None:
    """The config fields of a model: its local config.json, the hub cache's, or the known sizes of an alias."""
    path = MODEL_ALIASES.get(name, name)
    local = os.path.join(path, "config.json")
    if not os.path.isfile(local) and not os.path.exists(path) and "/" in path:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            local = cached if isinstance(cached, str) else local
        except Exception:
            pass
    if os.path.isfile(local):
        try:
            with open(local, encoding="utf-8") as f:
                config = json.load(f)
            config = config.get("text_config", config)   # multimodal wrappers keep the LM fields one level down
            if not all(k in config for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "vocab_size")):
                return None   # not a Qwen2/Llama-style config: no estimate rather than a wrong one
            config["head"] = prm_families.head_kind(config.get("architectures") or [])   # prm, token-classification, lm
            return config
        except (OSError, ValueError):
            return None
    return KNOWN_CONFIGS.get(path.split("/")[-1].removesuffix("-Instruct"))


def n_params(cfg: dict) -> int:
    """Parameters of a Qwen2/Llama-style decoder from its config: embeddings, attention (q/k/v with bias, o),
    SwiGLU MLP, norms, and an untied LM head (or the PRM's hidden→hidden→2 scoring head, or a token classifier's
    hidden→2 one)."""
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    per_layer = (h * heads * hd + heads * hd) + 2 * (h * kv * hd + kv * hd) + heads * hd * h \
        + 3 * h * cfg["intermediate_size"] + 2 * h
    head = {"prm": h * h + h + 2 * h + 2, "token-classification": 2 * h + 2}.get(
        cfg.get("head"), 0 if cfg.get("tie_word_embeddings") else v * h)
    return v * h + layers * per_layer + h + head


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """KV cache per token: 2 (K and V) · layers · kv_heads · head_dim · bytes."""
    heads = cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv * hd * dtype_bytes


# What cards report (torch.cuda.get_device_properties().total_memory) for their nominal size: RTX 4090 /
# A10-class 24 GB, A6000 / L40S-class 48 GB (the L40S reports 44.5), A100 / H100 80 GB, H200 141 GB.
CARD_GIB = {24: 23.6, 48: 47.5, 80: 79.2, 141: 139.8}
FIT_SHARE = 0.9           # a plan fits when it needs at most this share of the card (allocator fragmentation)
PROMPT_MAX = 1024         # prompt tokens the rollout engine's context allows on top of --max-new-tokens
CUDA_CONTEXT_GIB = 1.5    # CUDA context, cuBLAS workspaces, allocator rounding: not tensors, so not traced

# The update's activations and temporaries beyond fp32 weights, AdamW state and gradients (16 bytes per
# parameter), per micro-batch of n = micro_batch_size × (PROMPT_TOKENS + max_new_tokens) tokens, C = --logprob-chunk:
#     bytes = n · (a_h · h · L + a_i · I · L + a_v · V) + a_c · C · V + a_p · P
# (h hidden size, I MLP width, L layers, V vocabulary, P parameters). Fitted by `fit_constants` in
# tools/bench/memory.py to the traced peaks of `python -m tools.bench.memory --fit --full` (FakeTensorMode +
# MemTracker on our grpo micro-batch step: bf16 autocast, C = 512, two micro-batches, clip, AdamW.step): six
# small Qwen2 shapes and, with checkpointing, Qwen2.5-1.5B at 4 x 1,280 tokens (traced peak 30.13 GiB, planned
# 30.13). Largest error over the fitted traces: 1.7 % with checkpointing, 0.2 % without. With checkpointing
# a_h ≈ 11 is the saved fp32 input of each layer, a_v ≈ 4.5 the bf16 logits and their gradient, a_c ≈ 12
# the chunk's float32 log-softmax and its backward; a_p holds autocast's cached bf16 weight copies and AdamW's
# step temporaries. The no-checkpointing constants come from the small shapes only.
UPDATE_FIT = {   # checkpointing: (a_h, a_i, a_v, a_c, a_p)
    False: (38.773, 8.32, 7.181, 6.007, 1.773),
    True: (11.377, -0.187, 4.482, 12.396, 0.609),
}
# The PRM's bf16 no-grad scoring forward beyond its weights, per micro-batch of n tokens (prm_checkpoint's
# Qwen2ProcessRewardModel: decoder in bf16, score head in float32): bytes = n · (p_h · h + p_i · I). Fitted by
# least squares to `python -m tools.bench.memory --fit --only prm` (the six small shapes above; the vocabulary
# and the depth do not change the peak, which is one layer's working set: p_i ≈ 6 is three bf16 (n × I) tensors
# of the SwiGLU MLP, p_h the bf16 residual stream, its norms and the head's float32 input). Checked at full size
# by `python -m tools.bench.memory --only prm`: Qwen2.5-Math-PRM-7B scoring 4 x 1,280 tokens traced 13.90 GiB
# (weights 13.22, activations 0.69), planned 13.93 (activations 0.74).
PRM_FIT = (9.442, 6.36)


# One rank of an FSDP2 update (--fsdp on GPUs: dist.shard with dist.mixed_precision, bf16 compute, no autocast,
# fp32 reduce-scatter every micro-batch, fused AdamW), beyond its fp32 shards (16 bytes per parameter / world),
# with gradient checkpointing, per micro-batch of n tokens: bytes = r · R + n · (f_h · h · L + f_v · V), R the
# root unit's parameters (embeddings, untied lm_head, final norm). At the traced peak the root is gathered in
# bf16 (2 R) beside 4 R of fp32 temporaries for its gradient, and every layer's checkpointed bf16 input is held
# (f_h = 2); f_v is the logits' share (their bf16 gradient, the chunked log-softmax).
# Fitted to two FSDPMemTracker traces on a fake process group (tools/bench/memory.py trace_fsdp_update;
# `python -m tools.bench.memory --model Qwen2.5-Math-7B --fsdp --world 8 --only update`): Qwen2.5-Math-7B at
# world 8, 4 x 1,280 tokens, 28 layers (traced 23.11 GiB, planned 23.12) and with 4 layers (traced 11.88,
# planned 11.88). Without checkpointing there is no FSDP2 trace: the one-GPU constants (UPDATE_FIT) stand in.
FSDP_FIT = (6.0, 2.0, 2.6)   # (r, f_h, f_v)


# The update's activations and temporaries of a LoRA policy (--lora-rank > 0: bf16 base, frozen; float32 adapters
# with their gradients and AdamW state, 16 bytes per adapter parameter) beyond 2 bytes per base parameter and those
# 16 per adapter parameter, per micro-batch of n tokens: the same terms as UPDATE_FIT, P the base's parameters.
# Fitted by `fit_constants` (tools/bench/memory.py) to `python -m tools.bench.memory --fit --only lora`: the six
# small shapes above traced with PEFT's get_peft_model (rank 16 on q, k, v, o, gate, up, down) under the same step
# (largest error 0.6 % with checkpointing, 0.02 % without). With checkpointing a_h ≈ 2 is each layer's saved bf16
# input (the frozen base keeps the residual stream in bf16, where the full update's float32 weights keep it in
# float32: a_h ≈ 11), a_v ≈ 6.4 the bf16 logits and their gradient.
LORA_UPDATE_FIT = {   # checkpointing: (a_h, a_i, a_v, a_c, a_p)
    False: (33.925, 8.718, 6.536, 7.354, -0.822),
    True: (2.284, -0.047, 6.427, 7.263, 0.382),
}
def lora_targets(args) -> tuple[str, ...]:
    """The decoder's linear layers that --lora-targets names (lora.targets_of)."""
    return lora.targets_of(getattr(args, "lora_targets", ""))


def lora_params(cfg: dict, rank: int, targets=lora.TARGETS.split(",")) -> int:
    """Parameters of PEFT's LoRA adapters of `rank` on each decoder layer's linear layers in `targets`: lora_A
    (rank × in) and lora_B (out × rank), r · (in + out) per layer."""
    h, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    kv, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return cfg["num_hidden_layers"] * rank * sum(sum(shapes[t]) for t in targets if t in shapes)


def lora_update_extra_bytes(cfg: dict, tokens: int, checkpointing: bool, chunk_tokens: int = 512) -> float:
    """Traced-constant estimate of a LoRA update's activations and temporaries (LORA_UPDATE_FIT)."""
    a_h, a_i, a_v, a_c, a_p = LORA_UPDATE_FIT[bool(checkpointing)]
    h, layers, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return tokens * (a_h * h * layers + a_i * inter * layers + a_v * v) + a_c * chunk_tokens * v + a_p * n_params(cfg)


def root_params(cfg: dict) -> int:
    """Parameters of FSDP2's root unit (what no decoder layer holds): the embedding, the output layer unless it is
    tied to the embedding, and the final norm."""
    return cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2) + cfg["hidden_size"]


def fsdp_update_bytes(cfg: dict, tokens: int) -> tuple[float, float]:
    """(gathered root unit, activations) of one FSDP2 rank's update with checkpointing (FSDP_FIT), in bytes."""
    r, f_h, f_v = FSDP_FIT
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    return r * root_params(cfg), tokens * (f_h * h * layers + f_v * v)


def update_extra_bytes(cfg: dict, tokens: int, checkpointing: bool, chunk_tokens: int = 512) -> float:
    """Traced-constant estimate of the update's activations and temporaries (UPDATE_FIT)."""
    a_h, a_i, a_v, a_c, a_p = UPDATE_FIT[bool(checkpointing)]
    h, layers, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return tokens * (a_h * h * layers + a_i * inter * layers + a_v * v) + a_c * chunk_tokens * v + a_p * n_params(cfg)


def prm_scoring_bytes(cfg: dict, tokens: int) -> float:
    """Traced-constant estimate of the PRM's scoring activations for a micro-batch of `tokens` (PRM_FIT)."""
    p_hidden, p_inter = PRM_FIT
    logits = 2 * cfg["vocab_size"] if cfg.get("head") == "lm" else 0   # an LM head: bf16 logits at every position
    return tokens * (p_hidden * cfg["hidden_size"] + p_inter * cfg["intermediate_size"] + logits)


def world_size() -> int:
    """The number of torchrun processes (WORLD_SIZE, as dist.init reads it); 1 without torchrun."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def rollout_kv_need(args, world: int | None = None) -> tuple[int | None, int]:
    """(KV cache bytes, max_model_len) of the policy's vLLM engine sized by need: the sequences this process
    samples, prompts_per_step / world × group_size (under torchrun each rank's engine samples its own groups),
    of PROMPT_TOKENS + max_new_tokens; the context allows PROMPT_MAX prompt tokens and the larger of the
    training and evaluation budgets (the caller clamps it to the model's own context). (None: no config.)
    world: the torchrun processes (None: world_size())."""
    world = world_size() if world is None else world
    cfg = model_config(args.model)
    max_len = PROMPT_MAX + max(args.max_new_tokens, args.eval_max_new_tokens)   # the engine also evaluates
    if cfg is None:
        return None, max_len
    tokens = -(-args.prompts_per_step // world) * args.group_size * (PROMPT_TOKENS + args.max_new_tokens)
    return max(tokens, max_len) * kv_bytes_per_token(cfg), max_len   # vLLM needs room for one full-length request


# The in-process engine's batch limits, passed to vllm.LLM (harness/run/wiring.make_rollout_engine). Left unset, vLLM 0.33
# takes 256 sequences and 8,192 batched tokens on a card under 70 GiB, 1,024 and 16,384 on an H100 or H200
# (vllm/engine/arg_utils.py:2973-3006, EngineArgs.get_batch_defaults), and sizes its sampler and graph buffers by them.
ROLLOUT_BATCHED_TOKENS = 8192   # a prefill step's tokens: vLLM's own figure below 70 GiB, for every card
VLLM_GRAPH_TOKENS_MAX = 512     # vLLM 0.33 captures decode CUDA graphs of up to min(2 · max_num_seqs, 512) tokens
                                # (vllm/config/vllm.py:2464-2470, _set_cudagraph_sizes; 1,024 on Blackwell)


def rollout_engine_limits(args, world: int | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of the in-process engine: every rollout of the rank's one generate call
    at once (prompts_per_step / world × group_size, as rollout_kv_need sizes its KV cache), and ROLLOUT_BATCHED_TOKENS
    (at least max_num_seqs: vLLM refuses fewer, vllm/config/scheduler.py:331)."""
    world = world_size() if world is None else world
    seqs = -(-args.prompts_per_step // world) * args.group_size
    return seqs, max(ROLLOUT_BATCHED_TOKENS, seqs)


def vllm_runtime_bytes(cfg: dict, max_num_seqs: int, batched_tokens: int) -> tuple[float, float]:
    """(the CUDA graph pool, the rest) bytes of vLLM 0.33's own buffers beside its weights and KV cache (Model Runner
    V2, vllm/v1/worker/gpu/; not traced). The graph pool, a forward's working set at the largest captured decode
    batch, is captured after the memory pools of sleep mode (vllm/v1/worker/gpu_worker.py:933-990), so sleep(level=2)
    keeps it. The rest lives and sleeps with the weights: the sampler is built in load_model, inside the "weights"
    pool (gpu_worker.py:594-596, gpu/model_runner.py:495), with the penalties' output_bin_counts, max_num_seqs × V
    int32 (sample/penalties.py:45-50); and in a generate call one step's bf16 logits of max_num_seqs rows with the
    sampler's float32 copy of them, which our logit_bias (the surplus ban) needs (sample/sampler.py:239-240), and a
    prefill step's working set at max_num_batched_tokens. A forward's working set is the PRM's traced one (PRM_FIT:
    one layer's bf16 no-grad activations, from our HF module; vLLM's fused kernels hold less)."""
    v = cfg["vocab_size"]
    graphs = prm_scoring_bytes(cfg, min(2 * max_num_seqs, VLLM_GRAPH_TOKENS_MAX))
    return graphs, (4 + 6) * max_num_seqs * v + prm_scoring_bytes(cfg, batched_tokens)


PRM_SERVED_KV_TOKENS = 32768   # the served PRM's KV cache: ~36 failures of 900 tokens in one prefill wave
PRM_PREFILL_TOKENS = 4096      # the served PRM's max_num_batched_tokens: one prefill step of 4,096 tokens


def prm_served(args, use_vllm: bool, gpu_gib: float | None = None, world: int | None = None) -> bool:
    """The PRM runs on its own `vllm serve --runner pooling` (harness/engines/served_prm.py): with vLLM on a GPU, for a
    PRM whose config.json names Qwen2ForProcessRewardModel (a pooling model vLLM has natively), when the plan
    with it fits the card (`gpu_gib`, None: not known yet). Otherwise the PRM runs in this process, where it
    can wait in CPU memory during the update (--prm-offload)."""
    if args.prm == "none" or args.toy or not use_vllm or getattr(args, "backend", "") == "hf":
        return False
    cfg = model_config(args.prm)
    if cfg is None or not prm_families.servable(cfg.get("head")):
        return False
    rows = memory_plan(args, gpu_gib, use_vllm, prm_offload=False, world=world, prm_serve=True)[0]
    return gpu_gib is None or plan_total(rows) <= FIT_SHARE * gpu_gib


def prm_batched_tokens(args) -> int:
    """The served PRM's --max-num-batched-tokens: PRM_PREFILL_TOKENS, or the PRM's context when longer (STEP pooling
    has no chunked prefill, vllm/config/model.py:2205-2216, and then vLLM needs a whole sequence in one step,
    vllm/config/scheduler.py:318-329)."""
    cfg = model_config(args.prm) or {}
    return max(PRM_PREFILL_TOKENS, int(cfg.get("max_position_embeddings") or 0))


def prm_server_need(args) -> tuple[int, float]:
    """(KV cache bytes, GiB in all) of the served PRM: bf16 weights, a KV cache of PRM_SERVED_KV_TOKENS tokens, the
    activations of one prefill step of prm_batched_tokens (PRM_FIT, traced on our HF module: vLLM's own are smaller)
    and a CUDA context. Its `--gpu-memory-utilization` is this over the card."""
    cfg = model_config(args.prm)
    kv = PRM_SERVED_KV_TOKENS * kv_bytes_per_token(cfg)
    return kv, (2 * n_params(cfg) + kv + prm_scoring_bytes(cfg, prm_batched_tokens(args))) / GIB + CUDA_CONTEXT_GIB


def prm_offloaded(args, device: str, use_vllm: bool, gpu_gib: float | None = None, world: int | None = None) -> bool:
    """--prm-offload on/off, or auto: offload when the plan with the PRM resident does not fit the GPU (the plan
    of one process of `world`, None: world_size()). A served PRM (prm_served) is never offloaded: its memory is
    its server's."""
    if args.prm == "none" or args.toy or args.prm_offload == "off":
        return False
    if gpu_gib is None and device.startswith("cuda"):
        import torch

        gpu_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    if prm_served(args, use_vllm, gpu_gib, world):
        return False
    if args.prm_offload == "on":
        return True
    if gpu_gib is None:
        return False
    rows = memory_plan(args, gpu_gib, use_vllm, prm_offload=False, world=world, prm_serve=False)[0]
    return plan_total(rows) > FIT_SHARE * gpu_gib


def memory_plan(args, gpu_gib: float | None = None, use_vllm: bool = True, prm_offload: bool | None = None,
                world: int | None = None, prm_serve: bool | None = None,
                ) -> tuple[list[tuple[str, float, str]], list[str]]:
    """([(row, GiB, phase)], notes): the GPU memory one process of a run with these Args needs, by phase.

    phase "all": held the whole step; "update": only during the update; "other": only outside it (rollout,
    PRM, refinement). The peak (`plan_total`) is "all" + the larger of the other two. Rows:
    policy fp32 weights 4 + AdamW m and v 8 bytes per parameter (all); gradients 4 (update); the update's
    activations and temporaries from traced constants (UPDATE_FIT); KL reference fp32 (all); with --lora-rank the
    bf16 base (2 bytes per parameter, all), the adapters' 12 (all) and gradients' 4 bytes (update) per adapter
    parameter, activations from LORA_UPDATE_FIT, and no KL reference (the base with the adapters off);
    rollout engine: vLLM's bf16 weights + the KV cache of all B·G sequences (rollout_kv_need), asleep during
    the update with --rollout-sleep; HF generate: the KV cache of one micro-batch; PRM: bf16 weights, with
    --prm-offload only outside the update, + its scoring activations (PRM_FIT), or its own `vllm serve` (prm_served:
    prm_server_need, all step); a refiner on its own
    `vllm serve`: --refiner-mem of the card (its weights and KV cache when no card is known); CUDA context.
    Under torchrun (world: the processes, None = world_size(); each process owns one GPU) the rollout engine
    holds the KV cache of the rank's own groups; with --fsdp the policy's weights, AdamW state and gradients are
    sharded (÷ world), and with checkpointing the update's other terms are FSDP2's own, traced (FSDP_FIT: the
    root unit gathered in bf16 and reduce-scattered from fp32, bf16 activations); without checkpointing the
    root unit and two decoder layers gathered and one GPU's activations stand in (not traced). DDP holds its
    gradient buckets (fp32, one more copy of the gradients) all step (arithmetic, not traced). The rest is per
    process as on one GPU."""
    world = world_size() if world is None else world
    if args.toy:
        return [("toy world (CPU)", 0.1, "all")], []
    notes, rows = [], []
    cfg = model_config(args.model)
    if cfg is None:
        return [], [f"no config for '{args.model}' (not local, not cached, not an alias): no memory plan"]
    p, T = n_params(cfg), PROMPT_TOKENS + args.max_new_tokens
    if prm_serve is None:
        prm_serve = prm_served(args, use_vllm, gpu_gib, world)
    if prm_offload is None:
        prm_offload = not prm_serve and prm_offloaded(args, "cpu", use_vllm, gpu_gib, world)
    ckpt = bool(getattr(args, "gradient_checkpointing", False))
    shards = world if getattr(args, "fsdp", False) and world > 1 else 1
    sharded = f", sharded over {shards} processes (FSDP2)" if shards > 1 else ""
    rank = getattr(args, "lora_rank", 0)
    tokens = args.micro_batch_size * T
    if rank:   # LoRA: the bf16 base frozen (no gradient, no AdamW state); the adapters fp32 with their state
        a = lora_params(cfg, rank, lora_targets(args))
        rows.append((f"policy {p / 1e9:.2f} B params: bf16 base weights, frozen (LoRA)", 2 * p / GIB, "all"))
        rows.append((f"LoRA adapters {a / 1e6:.1f} M params (rank {rank}): fp32 weights + AdamW m, v", 12 * a / GIB,
                     "all"))
        rows.append(("LoRA adapter gradients (fp32)", 4 * a / GIB, "update"))
        rows.append((f"update activations + temporaries ({args.micro_batch_size} x {T} tokens, LoRA, checkpointing "
                     f"{'on' if ckpt else 'off'}; traced)",
                     lora_update_extra_bytes(cfg, tokens, ckpt, getattr(args, "logprob_chunk", 512)) / GIB, "update"))
        if shards > 1:
            notes.append("--fsdp with LoRA: planned as one GPU's LoRA update (not traced under FSDP2)")
    else:
        rows.append((f"policy {p / 1e9:.2f} B params: fp32 weights + AdamW m, v (12 B/param){sharded}",
                     12 * p / shards / GIB, "all"))
        rows.append((f"policy gradients (fp32){sharded}", 4 * p / shards / GIB, "update"))
    if not rank and shards > 1 and ckpt:   # traced with FSDPMemTracker (FSDP_FIT)
        gathered, activations = fsdp_update_bytes(cfg, tokens)
        rows.append(("FSDP2 root unit in the update: bf16 gathered + fp32 reduce-scatter input (traced)",
                     gathered / GIB, "update"))
        rows.append((f"update activations ({args.micro_batch_size} x {T} tokens, bf16, checkpointing on; "
                     f"FSDP2 traced)", activations / GIB, "update"))
    elif not rank:
        if shards > 1:   # no FSDP2 trace without checkpointing: the root + 2 layers gathered, and one GPU's terms
            root = root_params(cfg)
            layer = (p - root) / cfg["num_hidden_layers"]
            rows.append(("FSDP2 gathered in the update: root unit + 2 decoder layers, bf16 weights and fp32 "
                         "gradients (not traced)", 6 * (root + 2 * layer) / GIB, "update"))
        elif world > 1:
            rows.append(("DDP gradient buckets (fp32, not traced)", 4 * p / GIB, "all"))
        rows.append((f"update activations + temporaries ({args.micro_batch_size} x {T} tokens, checkpointing "
                     f"{'on' if ckpt else 'off'}; traced)",
                     update_extra_bytes(cfg, tokens, ckpt, getattr(args, "logprob_chunk", 512)) / GIB, "update"))
    if args.kl_coef > 0 and not rank:   # with LoRA the reference is the base with its adapters off: no weights
        rows.append(("KL reference (fp32)", 4 * p / GIB, "all"))
    if args.kl_coef > 0:   # the reference's no-grad pass over each micro-batch, inside the update
        chunk = min(getattr(args, "logprob_chunk", 512) or tokens, tokens)
        rows.append((f"KL reference's pass: bf16 logits of {args.micro_batch_size} x {T} tokens + a float32 "
                     f"log-softmax chunk (not traced)", (2 * tokens + 8 * chunk) * cfg["vocab_size"] / GIB, "update"))
    if use_vllm:
        kv, _ = rollout_kv_need(args, world)
        sleep = bool(getattr(args, "rollout_sleep", False))
        rows.append((f"rollout engine: vLLM bf16 weights + KV of {-(-args.prompts_per_step // world)}x{args.group_size} x {T} "
                     f"tokens{' (asleep in the update)' if sleep else ''}", (2 * p + kv) / GIB,
                     "other" if sleep else "all"))
        seqs, batched = rollout_engine_limits(args, world)
        graphs, awake = vllm_runtime_bytes(cfg, seqs, batched)
        rows.append(("vLLM runtime (not traced): the CUDA graph pool (held through sleep)", graphs / GIB, "all"))
        rows.append((f"vLLM runtime (not traced): output_bin_counts, logits and the sampler's float32 copy of {seqs} "
                     f"sequences, one prefill step of {batched} tokens{' (asleep in the update)' if sleep else ''}",
                     awake / GIB, "other" if sleep else "all"))
    else:
        # HF generate holds the KV cache of --gen-batch-size rows, in the rollouts and in the evaluation
        new = max(args.max_new_tokens, args.eval_max_new_tokens if getattr(args, "eval_every", 0) else 0)
        what = "rollouts" if new == args.max_new_tokens else f"evaluation, --eval-max-new-tokens {new}"
        rows.append((f"rollout KV cache (HF generate, {args.gen_batch_size} sequences x {PROMPT_TOKENS + new} tokens: "
                     f"{what})", args.gen_batch_size * (PROMPT_TOKENS + new) * kv_bytes_per_token(cfg) / GIB, "other"))
    if prm_serve:
        rows.append((f"PRM: its own vllm serve (pooling runner, bf16 weights, KV of {PRM_SERVED_KV_TOKENS} tokens, "
                     f"one prefill's activations, its CUDA context)", prm_server_need(args)[1], "all"))
    elif args.prm != "none":
        prm_cfg = model_config(args.prm)
        if prm_cfg is None:
            notes.append(f"no config for PRM '{args.prm}': left out of the plan")
        else:
            rows.append((f"PRM {n_params(prm_cfg) / 1e9:.2f} B params (bf16){', in CPU memory in the update' if prm_offload else ''}",
                         2 * n_params(prm_cfg) / GIB, "other" if prm_offload else "all"))
            rows.append((f"PRM scoring ({4} x {T} tokens; traced)", prm_scoring_bytes(prm_cfg, 4 * T) / GIB, "other"))
    if args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        ref_cfg = model_config(args.refiner)
        if gpu_gib:
            rows.append((f"refiner: its own vllm serve, --refiner-mem {args.refiner_mem:.0%} of the card",
                         args.refiner_mem * gpu_gib, "all"))
        elif ref_cfg is None:
            notes.append(f"no config for refiner '{args.refiner}': left out of the plan")
        else:
            # HF generate holds one --gen-batch-size batch; beside vLLM it is served, KV of a micro-batch assumed
            batch = args.micro_batch_size if use_vllm else args.gen_batch_size
            rows.append((f"refiner {n_params(ref_cfg) / 1e9:.2f} B params (bf16) + KV cache (--refiner-mem of a card "
                         f"once one is known)", refiner_gib(args, ref_cfg, batch), "all"))
    rows.append(("CUDA context, workspaces (not traced)", CUDA_CONTEXT_GIB, "all"))
    chunk = min(getattr(args, "logprob_chunk", 512) or tokens, tokens)
    # autocast caches a bf16 copy of every float32 weight (they require grad) until the pass leaves its autocast
    pass_row = (f"{OLD_LOGP_ROW} (--overlap-old-logp): autocast's bf16 weight copies + bf16 logits of "
                f"{args.micro_batch_size} x {T} tokens + a float32 log-softmax chunk (not traced)",
                ((0 if rank else 2 * p) + (2 * tokens + 8 * chunk) * cfg["vocab_size"]) / GIB, "other")
    if old_logp_beside(args, rows + [pass_row], gpu_gib):
        rows.insert(-1, pass_row)
    return rows, notes


OLD_LOGP_ROW = "π_old pass beside the PRM and refiner"


def old_logp_beside(args, rows_with_it, gpu_gib: float | None) -> bool:
    """--overlap-old-logp on a GPU: on, off, or auto = where the pass exists (overlap.enabled) and the plan with
    its working set held beside the rollout, PRM and refiner phases fits the card (its lowest priority)."""
    from harness.engines import overlap   # torch: imported here, not when --help parses the flags

    if args.overlap_old_logp != "auto":
        return args.overlap_old_logp == "on"
    return overlap.enabled(args, "cuda") and (gpu_gib is None or plan_total(rows_with_it) <= FIT_SHARE * gpu_gib)


def old_logp_overlapped(args, device: str, use_vllm: bool) -> bool:
    """Whether this run computes π_old beside the PRM and refiner: on the CPU overlap.enabled (auto: off), on a GPU
    as its memory plan has it (old_logp_beside)."""
    from harness.engines import overlap

    if not device.startswith("cuda") or args.overlap_old_logp != "auto":
        return overlap.enabled(args, device)
    import torch

    gpu_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    return any(name.startswith(OLD_LOGP_ROW) for name, _, _ in memory_plan(args, gpu_gib, use_vllm)[0])


def refiner_gib(args, cfg: dict, batch: int) -> float:
    """GiB of a refiner: bf16 weights + the KV cache of `batch` sequences of PROMPT_TOKENS + max_new_tokens tokens
    (HF generate in this process: batch = --gen-batch-size)."""
    T = PROMPT_TOKENS + args.max_new_tokens
    return (2 * n_params(cfg) + batch * T * kv_bytes_per_token(cfg)) / GIB


def refiner_fallback_refusal(args, free_gib: float, total_gib: float, reason: str, log_path: str) -> str | None:
    """The refiner's own `vllm serve` did not start: None when HF generate may hold the refiner instead (the
    plan's refiner row, `refiner_gib`, plus 1 GiB fits in `free_gib`, the GPU memory free now), else the one
    line that stops the run, naming the flags that fit: a --refiner-mem share that the free memory holds and
    that holds the bf16 weights with 2 GiB of KV cache (when there is one), --refiner-url, --refiner policy."""
    cfg = model_config(args.refiner)
    need = None if cfg is None else refiner_gib(args, cfg, args.gen_batch_size) + 1.0
    if need is not None and need <= free_gib:
        return None
    ways = []
    if cfg is not None and total_gib > 0:
        low, high = (2 * n_params(cfg) / GIB + 2.0) / total_gib, (free_gib - 0.5) / total_gib
        share = int(high * 100) / 100   # rounded down: vLLM checks at start that its share is free
        if share >= low and share != args.refiner_mem:
            ways.append(f"--refiner-mem {share:.2f}")
    ways += ["--refiner-url http://HOST:8000/v1 (vllm serve the refiner elsewhere)", "--refiner policy"]
    why = "for lack of GPU memory" if "memory" in reason.lower() else "(see its log)"
    held = "an unknown size" if need is None else f"about {need:.0f} GiB"
    return (f"the refiner server (vllm serve {args.refiner}, --refiner-mem {args.refiner_mem}) did not start {why}; "
            f"log {log_path}. Refining through HF generate on this GPU would need {held} of the {free_gib:.0f} GiB "
            f"free, so the run stops instead; it fits with: {' | '.join(ways)}")


def plan_total(rows) -> float:
    """The peak: what is held all step plus the larger of the update's and the rest of the step's rows."""
    phase = {k: sum(gib for _, gib, ph in rows if ph == k) for k in ("all", "update", "other")}
    return phase["all"] + max(phase["update"], phase["other"])


def fixes(args, gpu_gib: float, use_vllm: bool) -> list[str]:
    """Flag changes (fewest first) under which the plan fits in FIT_SHARE of gpu_gib."""
    from dataclasses import replace

    options = [{}]
    if not args.gradient_checkpointing:
        options.append({"gradient_checkpointing": True})
    if args.prm != "none" and args.prm_offload == "off":
        options.append({"prm_offload": "on"})
    if use_vllm and not args.rollout_sleep:
        options.append({"rollout_sleep": True})
    if args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        options += [{"refiner": "policy"}, {"refiner_url": "http://HOST:8000/v1"}]
    # a small card: LoRA, the 1.5B PRM, self-refinement (docs/memory.md, "A 24 GB card")
    adapter = {} if getattr(args, "lora_rank", 0) else {"lora_rank": 16}
    small = {"prm": TRL_PRM} if args.mode in MODES_WITH_PRM and args.prm not in ("none", TRL_PRM) else {}
    if small and args.mode in MODES_WITH_REFINER and args.refiner != "policy" and not args.refiner_url:
        small["refiner"] = "policy"
    for change in (adapter, small, {**adapter, **small}):
        if change and change not in options:
            options.append(change)
    found = []
    for change in options:
        mb = args.micro_batch_size
        while mb >= 1:
            trial = replace(args, **change, micro_batch_size=mb)
            if plan_total(memory_plan(trial, gpu_gib, use_vllm)[0]) <= FIT_SHARE * gpu_gib:
                flags = [f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
                         for k, v in change.items()]
                flags += [f"--micro-batch-size {mb}"] if mb != args.micro_batch_size else []
                found.append(" ".join(flags) + (" (serve the refiner: vllm serve NAME)" if "refiner_url" in change else ""))
                break
            mb //= 2
    return [f for f in found if f][:3]


def format_plan(args, rows, notes, gpu_gib: float | None) -> str:
    lines = [f"memory plan (traced constants, GiB){'' if gpu_gib is None else f' on a {gpu_gib:.1f} GiB GPU'}"
             f"{'' if gpu_gib is None else '; total = the peak: all step + the larger of update / outside the update'}:"]
    where = {"all": "all step", "update": "update", "other": "outside the update"}
    lines += [f"  {gib:7.1f}  [{where[ph]}] {row}" for row, gib, ph in rows]
    total = plan_total(rows)
    if gpu_gib is not None:   # the refiner's share depends on the card: a total only for a known one
        lines.append(f"  {total:7.1f}  total")
    if gpu_gib is None and not args.toy and rows:
        for size, gib in CARD_GIB.items():
            need = plan_total(memory_plan(args, gib, args.backend != "hf")[0])
            fits = need <= FIT_SHARE * gib
            ways = [] if fits else fixes(args, gib, args.backend != "hf")
            lines.append(f"  on a {size} GB GPU ({gib:.1f} GiB reported): {need:.1f} GiB, " + (
                "fits" if fits else "does not fit" + (f"; fits with {' | '.join(ways)}" if ways else "")))
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)
