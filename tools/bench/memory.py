"""memory.py — the GPU memory of our own update, PRM scoring and refiner, traced on fake tensors.

Not part of the paper. `harness/run/preflight.py`'s memory plan takes its per-parameter and per-token constants
from the traces this tool runs; run it to see traced beside planned, per component, for any config:

    python -m tools.bench.memory                                  # Qwen2.5-1.5B policy, 7B PRM and refiner, 16x8
    python -m tools.bench.memory --model Qwen2.5-0.5B --prm none   # any scope.py flags
    python -m tools.bench.memory --only prm                       # only the 7B PRM's scoring batch
    python -m tools.bench.memory --model Qwen2.5-Math-7B --fsdp --world 8 --only update
                                       # one rank of the 8-GPU FSDP2 update (FSDPMemTracker, fake process group)
    python -m tools.bench.memory --fit                            # the small traces the plan's constants come from
    python -m tools.bench.memory --table                          # docs/memory.md's per-card table, from the plan
    OMP_NUM_THREADS=1 python -m tools.bench.memory --time-update 2x160 --model Qwen2.5-0.5B --micro-batch-size 2
                                       # grpo.update for real on the CPU, with and without checkpointing

How: PyTorch's FakeTensorMode builds the model from its real config.json (the alias table in preflight when
offline) with fake tensors (shapes and dtypes, no storage: nothing is allocated, no weights are needed), and
torch.distributed._tools.mem_tracker.MemTracker records every tensor's bytes by category while our own code
runs: grpo's micro-batch step as `grpo.update` runs it (`trainer.forward_logprobs` → `policy_loss` → backward, for
two micro-batches so that the first one's gradients exist during the second, then clip_grad_norm_ and
AdamW.step with its state already there, as from the second step on), under the run's bfloat16 autocast and
with the run's gradient checkpointing and log-prob chunk; and the PRM's bf16 scoring forward of one batch.
`grpo.update` itself is not called: its host-side bookkeeping (row lengths, float(loss)) needs real numbers.
With `--fsdp --world N`, one rank of an N-process FSDP2 update instead: `dist.shard` with the run's bf16
MixedPrecisionPolicy on a fake process group, traced by torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker
(`trace_fsdp_update`).

What the trace cannot see: the fake tensors are CPU tensors, so the CPU kernels are the ones traced.
Attention runs as PyTorch's CPU scaled_dot_product_attention (flash-style, no T × T scores kept), as CUDA's
flash / memory-efficient kernels do, but their workspaces differ; CUDA's caching allocator rounds and
fragments (the plan adds slack for it); the CUDA context, cuBLAS workspaces and NCCL buffers are not tensors;
vLLM (the rollout engine, the refiner's server) is not traced: the plan counts what it is told to reserve.
"""
import argparse
import json
import time

import torch

GIB = 2 ** 30


def fake_model(cfg: dict, dtype=torch.float32, prm: bool = False):
    """A Qwen2 causal LM, or with `prm` harness/engines/prm_checkpoint.py's Qwen2ProcessRewardModel (the decoder without LM
    head and a float32 hidden→hidden→2 head), or for a token-classification PRM (cfg["head"]) transformers'
    Qwen2ForTokenClassification in `dtype`, built from `cfg` (on fake tensors inside FakeTensorMode)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "tie_word_embeddings", "head_dim", "rope_theta", "max_position_embeddings")
    config = Qwen2Config(**{k: cfg[k] for k in keys if cfg.get(k) is not None}, num_labels=2)
    config._attn_implementation = "sdpa"
    config.torch_dtype = dtype
    if not prm or cfg.get("head") == "token-classification":
        torch.set_default_dtype(dtype)   # built in its dtype (a fake tensor cannot be converted in place)
        try:
            return Qwen2ForTokenClassification(config) if prm else Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    from harness.engines import prm_checkpoint

    torch.set_default_dtype(dtype)   # our own PRM module: the decoder in the run's dtype ...
    try:
        model = prm_checkpoint.Qwen2ProcessRewardModel(config)
    finally:
        torch.set_default_dtype(torch.float32)
    h = config.hidden_size           # ... and the score head in float32, as prm_checkpoint.load_qwen2_prm loads it
    model.score = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 2))
    return model


def fake_from_meta(model):
    """`model` with every parameter and buffer of the meta device replaced by a fake CPU tensor of its shape, dtype
    and requires_grad (call inside FakeTensorMode); tied parameters stay tied."""
    made = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def lora_model(cfg: dict, rank: int, targets: tuple[str, ...]):
    """The policy as a LoRA run holds it: the Qwen2 causal LM in bfloat16, frozen, with PEFT's LoRA adapters of
    `rank` on the decoder's linear layers named in `targets` (get_peft_model: the adapters in float32, PEFT's
    default autocast_adapter_dtype). Built on the meta device and made fake by the caller (fake_from_meta):
    PEFT moves each new adapter with Module.to, which cannot swap fake parameters (torch 2.13, PEFT 0.21.2)."""
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        base = fake_model(cfg, torch.bfloat16)
        return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                               target_modules=list(targets)))


class _NoHook:
    def remove(self):
        pass


def skip_frozen(tracker, model) -> None:
    """Let `tracker` (a MemTracker) track a model with frozen parameters: it registers a gradient hook on every
    parameter it meets, which raises on one that needs no gradient (torch 2.13's mem_tracker.py
    `_track_module_params_and_buffers`); a frozen parameter is marked as hooked already (private state)."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def peak_of(tracker) -> dict:
    """{category: bytes} of the tracker's peak, plus 'total'."""
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {("total" if str(k) == "Total" else k.value.lower()): int(v) for k, v in snap.items()}


def warm_adamw(params: list, fused: bool) -> torch.optim.AdamW:
    """AdamW whose state already exists (it is allocated at the first step): one step on zero gradients."""
    opt = torch.optim.AdamW(params, lr=1e-6, fused=fused)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def fake_batch(cfg: dict, rows: int, tokens: int) -> tuple:
    """One micro-batch of `rows` × `tokens` (a prompt of min(256, tokens/4), the rest response) and advantages."""
    prompt = min(256, tokens // 4)
    ids = torch.randint(0, cfg["vocab_size"], (rows, tokens))
    attn = torch.ones(rows, tokens, dtype=torch.long)
    resp = torch.zeros(rows, tokens, dtype=torch.long)
    resp[:, prompt:] = 1
    return ids, attn, resp, torch.randn(rows)


def trace_update(cfg: dict, rows: int, tokens: int, *, checkpointing: bool, chunk_tokens: int = 512,
                 entropy_coef: float = 0.0, fused: bool = False, lora_rank: int = 0, lora_targets=()) -> dict:
    """Peak bytes by category of two micro-batches of `rows` × `tokens` (prompt + response) through grpo's
    micro-batch step, then clip_grad_norm_ and AdamW.step (state already allocated), as grpo.update runs them.
    With `lora_rank`, the LoRA policy (lora_model): the bf16 base frozen, gradients, clip and AdamW over the
    adapters alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import grpo
    from harness.engines import trainer

    meta = lora_model(cfg, lora_rank, tuple(lora_targets)) if lora_rank else None
    with FakeTensorMode():
        model = fake_model(cfg) if meta is None else fake_from_meta(meta)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt, (ids, attn, resp, adv) = warm_adamw(params, fused), fake_batch(cfg, rows, tokens)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        skip_frozen(tracker, model)
        with tracker:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logp, entropy = trainer.forward_logprobs(model, ids, attn, resp, grpo.logprobs_and_entropy,
                                                             entropy_grad=entropy_coef != 0, keep=tokens,
                                                             chunk_tokens=chunk_tokens)
                    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, resp, torch.zeros_like(resp), z=rows * tokens,
                                               entropy=entropy, entropy_coef=entropy_coef)
                loss.backward()
                del logp, entropy, loss
                tracker.reset_mod_stats()   # per-module stats only; the peak is kept
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return peak_of(tracker)


def trace_fsdp_update(cfg: dict, world: int, rows: int, tokens: int, *, checkpointing: bool,
                      chunk_tokens: int = 512, fused: bool = True) -> dict:
    """Peak bytes by category of one rank of a `world`-process FSDP2 run, as `--fsdp` runs it on GPUs: the policy
    sharded by dist.shard with dist.mixed_precision (bf16 compute, fp32 reduce-scatter), no autocast, two
    micro-batches of `rows` × `tokens` through grpo's micro-batch step, each reduce-scattered, then
    clip_grad_norm_ and AdamW.step (state already allocated; `fused`: the run's --fused-adamw on a GPU, whose
    step has no parameter-sized temporaries). PyTorch's FSDPMemTracker on a fake process group
    (torch.testing's FakeStore: collectives return at once, without data) and FakeTensorMode; this process
    joins that group as rank 0 (it cannot be undone in the process: run it in its own, as the CLI does)."""
    import torch.distributed as tdist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import grpo
    from harness.engines import trainer
    from harness.engines import dist

    if not tdist.is_initialized():
        tdist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))   # outside FakeTensorMode: the mesh reads real rank tensors
    with FakeTensorMode():
        model = fake_model(cfg)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        dist.shard(model, mesh=mesh, mp_policy=dist.mixed_precision(True))
        opt, (ids, attn, resp, adv) = warm_adamw(list(model.parameters()), fused), fake_batch(cfg, rows, tokens)
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((ids, attn, resp))
        with tracker:
            for _ in range(2):
                logp, entropy = trainer.forward_logprobs(model, ids, attn, resp, grpo.logprobs_and_entropy,
                                                         entropy_grad=False, keep=tokens, chunk_tokens=chunk_tokens)
                loss, _ = grpo.policy_loss(logp, logp.detach(), adv, resp, torch.zeros_like(resp), z=rows * tokens,
                                           entropy=entropy)
                loss.backward()
                del logp, entropy, loss
                tracker.reset_mod_stats()
            # the same norm one tensor at a time: fake tensors run _foreach_norm on DTensor shards with
            # temporaries of all of them at once (traced: the size of the whole gradient), where CUDA's kernel
            # returns one float per tensor
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return peak_of(tracker)


def trace_prm(cfg: dict, rows: int, tokens: int) -> dict:
    """Peak bytes by category of one bf16 no-grad scoring forward of `rows` × `tokens` through the PRM's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = fake_model(cfg, torch.bfloat16, prm=True).eval()
        ids = torch.randint(0, cfg["vocab_size"], (rows, tokens))
        attn = torch.ones(rows, tokens, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, torch.no_grad():   # as harness/engines/prm_engine.py PRMEngine.probs_at runs one micro-batch
            out = model(input_ids=ids, attention_mask=attn)
            probs = torch.softmax((out if torch.is_tensor(out) else out.logits).float(), dim=-1)[..., 1]
            del probs
        return peak_of(tracker)


# ------------------------------------------------------------------------------------------- the plan's constants
SMALL = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024, tie_word_embeddings=True)
FIT_SHAPES = [  # (config changes, rows, tokens per row): one dimension varied at a time
    ({}, 2, 512), ({"num_hidden_layers": 8}, 2, 512), ({"vocab_size": 16384}, 2, 512), ({}, 2, 1024),
    ({"intermediate_size": 2048}, 2, 512), ({"hidden_size": 512, "num_attention_heads": 8}, 2, 512)]


FULL_SHAPES = [("Qwen2.5-1.5B", 4, 1280)]   # the real run's micro-batch (minutes per trace on a CPU)


def features(cfg: dict, tokens: int, chunk_tokens: int = 512) -> list[float]:
    """The plan's terms (memory.UPDATE_FIT): n · h · L, n · I · L, n · V, C · V, P."""
    from harness.plan.memory import n_params

    h, L, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return [tokens * h * L, tokens * inter * L, tokens * v, chunk_tokens * v, n_params(cfg)]


def fit_constants(points: list[tuple[dict, int, int]], full_weight: float = 10.0,
                  held=None) -> tuple[tuple, float]:
    """Least squares of (traced peak − what the weights and their state hold) on `features`, relative to each peak
    (so small and full-size traces count alike; a full-size point weighs `full_weight`). points: (cfg, tokens, peak
    bytes); held: bytes per point (default 16 per parameter: fp32 weights, gradients, AdamW m and v).
    Returns (constants, largest relative error of the fitted plan against a point's peak)."""
    import numpy as np

    from harness.plan.memory import n_params

    X = np.array([features(c, n) for c, n, _ in points], float)
    peak = np.array([t for _, _, t in points], float)
    y = peak - np.array(held if held is not None else [16 * n_params(c) for c, _, _ in points], float)
    w = np.array([full_weight if n_params(c) > 1e8 else 1.0 for c, _, _ in points]) / peak
    coef = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
    return tuple(round(float(c), 3) for c in coef), float(np.max(np.abs(X @ coef - y) / peak))


def fit(full: bool, verbose: bool = True, only: str = "") -> dict:
    """Trace FIT_SHAPES (and with `full` the FULL_SHAPES) with and without checkpointing; fit preflight's
    UPDATE_FIT and PRM_FIT (`only`: "update" or "prm" fits one of them)."""
    import numpy as np

    from harness.plan.memory import model_config, n_params

    out = {}
    small = [({**SMALL, **change}, rows, tokens) for change, rows, tokens in FIT_SHAPES]
    shapes = small + ([(model_config(name), rows, tokens) for name, rows, tokens in FULL_SHAPES] if full else [])
    for ckpt in (False, True) if only in ("", "update") else ():
        points = []
        for cfg, rows, tokens in shapes:
            t0 = time.time()
            peak = trace_update(cfg, rows, tokens, checkpointing=ckpt)
            points.append((cfg, rows * tokens, peak["total"]))
            if verbose:
                print(f"  checkpointing {ckpt!s:5}  L {cfg['num_hidden_layers']} h {cfg['hidden_size']} I "
                      f"{cfg['intermediate_size']} V {cfg['vocab_size']}  {rows}x{tokens}: peak "
                      f"{peak['total']} B ({time.time() - t0:.0f} s)", flush=True)
        out[str(ckpt)] = fit_constants(points)
    for ckpt in (False, True) if only in ("", "lora") else ():   # LoRA rank 16 on every linear layer
        from harness.plan.memory import lora_params
        from harness.run.preflight import LORA_TARGETS

        points, held = [], []
        for cfg, rows, tokens in small:
            t0 = time.time()
            peak = trace_update(cfg, rows, tokens, checkpointing=ckpt, lora_rank=16, lora_targets=LORA_TARGETS)
            points.append((cfg, rows * tokens, peak["total"]))
            held.append(2 * n_params(cfg) + 16 * lora_params(cfg, 16))   # the bf16 base; the adapters' fp32 state
            if verbose:
                print(f"  LoRA r16 checkpointing {ckpt!s:5}  L {cfg['num_hidden_layers']} h {cfg['hidden_size']} I "
                      f"{cfg['intermediate_size']} V {cfg['vocab_size']}  {rows}x{tokens}: peak "
                      f"{peak['total']} B ({time.time() - t0:.0f} s)", flush=True)
        out[f"lora {ckpt}"] = fit_constants(points, held=held)
    if only in ("", "prm"):   # the PRM's activations beyond its weights: n · (p_h · h + p_i · I), small shapes
        X, y = [], []
        for cfg, rows, tokens in small:
            peak = trace_prm(cfg, rows, tokens)
            X.append([rows * tokens * cfg["hidden_size"], rows * tokens * cfg["intermediate_size"]])
            y.append(peak["total"] - peak.get("parameter", 0))
            if verbose:
                print(f"  PRM  L {cfg['num_hidden_layers']} h {cfg['hidden_size']} I {cfg['intermediate_size']} "
                      f"V {cfg['vocab_size']}  {rows}x{tokens}: peak {peak['total']} B, beyond the weights "
                      f"{y[-1]} B", flush=True)
        coef = np.linalg.lstsq(np.array(X, float), np.array(y, float), rcond=None)[0]
        out["prm"] = tuple(round(float(c), 3) for c in coef)
    return out


# ------------------------------------------------------------------------------------------- traced vs planned
def compare(args, only: str = "", world: int = 1) -> None:
    """Trace the run's update micro-batches and PRM batch at the real shapes (`only`: "update" or "prm"
    alone); print them beside the plan. With --fsdp: one rank of `world` (trace_fsdp_update), the update only."""
    from harness.plan import memory

    cfg = memory.model_config(args.model)
    if cfg is None:
        raise SystemExit(f"--model {args.model}: no config (not local, not cached, not an alias)")
    p, T = memory.n_params(cfg), memory.PROMPT_TOKENS + args.max_new_tokens
    gib = memory.CARD_GIB[80]
    rows, _ = memory.memory_plan(args, gib, use_vllm=True)
    print(f"policy {args.model} ({p / 1e9:.2f} B params), micro-batch {args.micro_batch_size} x {T} tokens, "
          f"checkpointing {'on' if args.gradient_checkpointing else 'off'}, log-prob chunk {args.logprob_chunk}")
    print(f"  {'component':58} {'traced':>8} {'planned':>8}")
    if only in ("", "update") and args.fsdp:
        if world < 2:
            raise SystemExit("--fsdp: trace one rank of a torchrun world: pass --world N (N >= 2)")
        if not args.gradient_checkpointing:
            raise SystemExit("--fsdp: traced with --gradient-checkpointing only (the plan's FSDP_FIT)")
        t0 = time.time()
        peak = trace_fsdp_update(cfg, world, args.micro_batch_size, T, checkpointing=True,
                                 chunk_tokens=args.logprob_chunk)
        rows, _ = memory.memory_plan(args, gib, use_vllm=True, world=world)
        plan_update = sum(g for row, g, _ in rows if row.startswith(("policy", "FSDP2", "update"))) * GIB
        print(f"  {f'one rank of {world}, FSDP2 update peak (shards, root, activations)':58} "
              f"{peak['total'] / GIB:8.2f} {plan_update / GIB:8.2f}   ({(plan_update / peak['total'] - 1):+.1%}; "
              f"traced in {time.time() - t0:.0f} s; by category: "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in peak.items() if v and k != "total") + ")", flush=True)
        return
    if only in ("", "update"):
        t0 = time.time()
        rank, targets = getattr(args, "lora_rank", 0), memory.lora_targets(args)
        peak = trace_update(cfg, args.micro_batch_size, T, checkpointing=args.gradient_checkpointing,
                            chunk_tokens=args.logprob_chunk, entropy_coef=args.entropy_coef, lora_rank=rank,
                            lora_targets=targets)
        if rank:   # the bf16 base, the adapters' fp32 weights, gradients and AdamW state, LORA_UPDATE_FIT
            plan_update = 2 * p + 16 * memory.lora_params(cfg, rank, targets) + memory.lora_update_extra_bytes(
                cfg, args.micro_batch_size * T, args.gradient_checkpointing, args.logprob_chunk)
        else:
            plan_update = 16 * p + memory.update_extra_bytes(cfg, args.micro_batch_size * T,
                                                                args.gradient_checkpointing, args.logprob_chunk)
        print(f"  {'update peak: weights + AdamW + grads + activations/temps':58} {peak['total'] / GIB:8.2f} "
              f"{plan_update / GIB:8.2f}   ({(plan_update / peak['total'] - 1):+.1%}; traced in "
              f"{time.time() - t0:.0f} s; by category: "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in peak.items() if v and k != "total") + ")", flush=True)
    if args.prm != "none" and only in ("", "prm"):
        prm_cfg = memory.model_config(args.prm)
        if prm_cfg is None:
            raise SystemExit(f"--prm {args.prm}: no config (not local, not cached, not an alias)")
        rows_prm = 4   # prm.ProcessRewardModel's micro_batch_size
        t0 = time.time()
        ppeak = trace_prm(prm_cfg, rows_prm, T)
        plan_prm = 2 * memory.n_params(prm_cfg) + memory.prm_scoring_bytes(prm_cfg, rows_prm * T)
        print(f"  {f'PRM {args.prm} scoring {rows_prm} x {T} tokens (weights + activations)':58} "
              f"{ppeak['total'] / GIB:8.2f} {plan_prm / GIB:8.2f}   ({(plan_prm / ppeak['total'] - 1):+.1%}; "
              f"traced in {time.time() - t0:.0f} s; by category: "
              + ", ".join(f"{k} {v / GIB:.2f}" for k, v in ppeak.items() if v and k != "total") + ")", flush=True)
    for row, g, phase in rows:
        if row.startswith(("rollout", "refiner", "CUDA")):
            print(f"  {row[:58]:58} {'-':>8} {g:8.2f}   (not traced: {'a vLLM reservation' if 'CUDA' not in row else 'not tensors'})")
    print(memory.format_plan(args, rows, [], gib))


# ------------------------------------------------------------------------------------------- update time, for real
def time_update(args, rows: int, tokens: int, repeats: int) -> None:
    """grpo.update for real on the CPU (random weights of --model's config, float32, AdamW), with and without
    gradient checkpointing, alternating, `repeats` timed steps each after one untimed warm-up; medians."""
    import statistics

    import grpo
    from harness.plan import memory

    import os

    torch.manual_seed(0)
    cfg = memory.model_config(args.model)
    t0 = time.perf_counter()
    model = fake_model(cfg).train()   # outside FakeTensorMode: a real, randomly initialised model
    print(f"  built and randomly initialised {args.model}'s shape in {time.perf_counter() - t0:.1f} s (not timed "
          f"below); timed: grpo.update alone (forward, loss, backward, clip, AdamW.step), after one warm-up step "
          f"per setting that also allocates AdamW's state", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)   # one model and optimizer; checkpointing toggled
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10000, (rows, tokens), generator=g)
    resp = torch.zeros(rows, tokens, dtype=torch.long)
    resp[:, tokens // 4:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp,
             "offpolicy_mask": torch.zeros_like(ids), "advantages": torch.randn(rows, generator=g)}
    times = {False: [], True: []}
    for k in range(repeats + 1):
        for ckpt in (False, True):
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            t0 = time.perf_counter()
            grpo.update(model, opt, batch, micro_batch_size=args.micro_batch_size, max_new_tokens=tokens,
                        chunk_tokens=args.logprob_chunk)
            if k:
                times[ckpt].append(time.perf_counter() - t0)
                print(f"  step {k} checkpointing {'on ' if ckpt else 'off'}: {times[ckpt][-1]:.2f} s (load average "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    if not times[False]:
        raise SystemExit("--repeats: at least 1 timed step per setting")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}-shaped policy, {rows} x {tokens} tokens, micro-batch {args.micro_batch_size}, "
          f"{torch.get_num_threads()} threads: median update {off:.2f} s without checkpointing, {on:.2f} s with "
          f"({on / off - 1:+.0%})")


# ------------------------------------------------------------------------------------------- docs/memory.md's table
TABLE_RUNS = [   # (command shown, flags): the combinations of docs/memory.md's per-card table
    ("`--model Qwen2.5-1.5B` (7B PRM, 7B refiner)", "--model Qwen2.5-1.5B"),
    ("`--model Qwen2.5-1.5B --refiner policy`", "--model Qwen2.5-1.5B --refiner policy"),
    ("`--model Qwen2.5-1.5B --refiner-url URL` (refiner served elsewhere)",
     "--model Qwen2.5-1.5B --refiner-url http://HOST:8000/v1"),
    ("`--model Qwen2.5-1.5B --mode grpo --prm none`", "--model Qwen2.5-1.5B --mode grpo --prm none"),
    ("`--model Qwen2.5-1.5B --no-gradient-checkpointing --no-rollout-sleep --prm-offload off`",
     "--model Qwen2.5-1.5B --no-gradient-checkpointing --no-rollout-sleep --prm-offload off"),
    ("`--model Qwen2.5-1.5B --lora-rank 16 --prm HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2 --refiner policy`",
     "--model Qwen2.5-1.5B --lora-rank 16 --prm HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2 --refiner policy"),
    ("`--model Qwen2.5-0.5B --prm HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2 --refiner policy` (full fine-tune)",
     "--model Qwen2.5-0.5B --prm HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2 --refiner policy"),
    ("`--model Qwen2.5-1.5B --lora-rank 16 --mode grpo --prm none`", "--model Qwen2.5-1.5B --lora-rank 16 --mode grpo --prm none"),
    ("`--model Qwen2.5-Math-7B` (7B PRM, 7B refiner)", "--model Qwen2.5-Math-7B"),
    ("`--model Qwen2.5-Math-7B --mode grpo --prm none`", "--model Qwen2.5-Math-7B --mode grpo --prm none"),
]


def memory_table() -> str:
    """docs/memory.md's per-card table: for each of TABLE_RUNS the peak that `--dry-run` prints per card
    (memory.format_plan's per-card lines: the plan, whether it fits FIT_SHARE of the card, the fixes)."""
    import scope
    from harness.plan import memory

    lines = ["| command | " + " | ".join(f"{size} GB ({gib:.1f} GiB)" for size, gib in memory.CARD_GIB.items()) + " |",
             "| --- |" + " --- |" * len(memory.CARD_GIB)]
    for shown, flags in TABLE_RUNS:
        args = scope.parse_args(flags.split())
        cells = []
        for gib in memory.CARD_GIB.values():
            need = memory.plan_total(memory.memory_plan(args, gib, True)[0])
            if need <= memory.FIT_SHARE * gib:
                offloaded = memory.prm_offloaded(args, "cpu", True, gib) and args.prm_offload == "auto"
                cells.append(f"{need:.1f}: fits" + (" (PRM offloaded)" if offloaded else ""))
            else:
                ways = memory.fixes(args, gib, True)
                ways = [f"`{w.split(' (')[0]}`" + (f" ({w.split(' (', 1)[1]}" if " (" in w else "") for w in ways]
                cells.append(f"{need:.1f}: no" + (f"; fits with {' / '.join(ways)}" if ways else ""))
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="trace the small shapes and print the plan's constants")
    parser.add_argument("--table", action="store_true", help="print docs/memory.md's per-card table from the plan")
    parser.add_argument("--full", action="store_true", help="with --fit: also trace Qwen2.5-1.5B's micro-batch")
    parser.add_argument("--time-update", metavar="ROWSxTOKENS", default="",
                        help="time grpo.update for real on the CPU, with and without checkpointing (e.g. 2x160)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per setting with --time-update")
    parser.add_argument("--world", type=int, default=1, help="with --fsdp: the torchrun world one rank is traced in")
    parser.add_argument("--only", choices=("update", "prm", "lora"), default="",
                        help="trace (or with --fit: fit) only the update, only the PRM's scoring batch, or (--fit) "
                             "only the LoRA update's constants")
    known, rest = parser.parse_known_args(argv)
    if known.fit:
        print(json.dumps(fit(known.full, only=known.only), indent=1))
        return
    if known.table:
        print(memory_table())
        return
    import scope

    args = scope.parse_args(rest)
    if known.time_update:
        rows, tokens = (int(x) for x in known.time_update.lower().split("x"))
        time_update(args, rows, tokens, known.repeats)
        return
    compare(args, known.only, known.world)


if __name__ == "__main__":
    main()
