"""bench_memory.py — the GPU memory of our own update, PRM scoring and refiner, traced on fake tensors.

Not part of the paper. `harness/preflight.py`'s memory plan takes its per-parameter and per-token constants
from the traces this tool runs; run it to see traced beside planned, per component, for any config:

    python -m tools.bench_memory                                  # Qwen2.5-1.5B policy, 7B PRM and refiner, 16x8
    python -m tools.bench_memory --model Qwen2.5-0.5B --prm none   # any scope.py flags
    python -m tools.bench_memory --fit                            # the small traces the plan's constants come from

How: PyTorch's FakeTensorMode builds the model from its real config.json (the alias table in preflight when
offline) with fake tensors (shapes and dtypes, no storage: nothing is allocated, no weights are needed), and
torch.distributed._tools.mem_tracker.MemTracker records every tensor's bytes by category while our own code
runs: grpo's micro-batch step as `grpo.update` runs it (`_forward_logprobs` → `policy_loss` → backward, for
two micro-batches so that the first one's gradients exist during the second, then clip_grad_norm_ and
AdamW.step with its state already there, as from the second step on), under the run's bfloat16 autocast and
with the run's gradient checkpointing and log-prob chunk; and the PRM's bf16 scoring forward of one batch.
`grpo.update` itself is not called: its host-side bookkeeping (row lengths, float(loss)) needs real numbers.

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
    """A Qwen2 causal LM (or the PRM: the decoder without LM head, a hidden→hidden→2 head) on fake tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "tie_word_embeddings", "head_dim", "rope_theta", "max_position_embeddings")
    config = Qwen2Config(**{k: cfg[k] for k in keys if cfg.get(k) is not None})
    config._attn_implementation = "sdpa"
    config.torch_dtype = dtype
    if not prm:
        torch.set_default_dtype(dtype)   # built in its dtype (a fake tensor cannot be converted in place)
        try:
            return Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    h = config.hidden_size

    class PRM(torch.nn.Module):   # the shape of Qwen2.5-Math-PRM-7B: decoder + Linear(h, h) → ReLU → Linear(h, 2)
        def __init__(self):
            super().__init__()
            self.model = Qwen2Model(config)
            self.score = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 2))

        def forward(self, input_ids, attention_mask):
            return self.score(self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)

    torch.set_default_dtype(dtype)
    try:
        return PRM()
    finally:
        torch.set_default_dtype(torch.float32)


def peak_of(tracker) -> dict:
    """{category: bytes} of the tracker's peak, plus 'total'."""
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {("total" if str(k) == "Total" else k.value.lower()): int(v) for k, v in snap.items()}


def trace_update(cfg: dict, rows: int, tokens: int, *, checkpointing: bool, chunk_tokens: int = 512,
                 entropy_coef: float = 0.0, fused: bool = False) -> dict:
    """Peak bytes by category of two micro-batches of `rows` × `tokens` (prompt + response) through grpo's
    micro-batch step, then clip_grad_norm_ and AdamW.step (state already allocated), as grpo.update runs them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import grpo

    with FakeTensorMode():
        model = fake_model(cfg)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        params = [p for p in model.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-6, fused=fused)
        for p in params:   # AdamW's state exists from the second step on: make it exist before tracing
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        prompt = min(256, tokens // 4)
        ids = torch.randint(0, cfg["vocab_size"], (rows, tokens))
        attn = torch.ones(rows, tokens, dtype=torch.long)
        resp = torch.zeros(rows, tokens, dtype=torch.long)
        resp[:, prompt:] = 1
        adv = torch.randn(rows)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logp, entropy = grpo._forward_logprobs(model, ids, attn, resp, entropy_grad=entropy_coef != 0,
                                                           keep=tokens, chunk_tokens=chunk_tokens)
                    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, resp, torch.zeros_like(resp), z=rows * tokens,
                                               entropy=entropy, entropy_coef=entropy_coef)
                loss.backward()
                del logp, entropy, loss
                tracker.reset_mod_stats()   # per-module stats only; the peak is kept
            torch.nn.utils.clip_grad_norm_(params, 1.0)
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
        with tracker, torch.no_grad():
            scores = model(ids, attn).softmax(-1)
            del scores
        return peak_of(tracker)


# ------------------------------------------------------------------------------------------- the plan's constants
SMALL = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024, tie_word_embeddings=True)
FIT_SHAPES = [  # (config changes, rows, tokens per row): one dimension varied at a time
    ({}, 2, 512), ({"num_hidden_layers": 8}, 2, 512), ({"vocab_size": 16384}, 2, 512), ({}, 2, 1024),
    ({"intermediate_size": 2048}, 2, 512), ({"hidden_size": 512, "num_attention_heads": 8}, 2, 512)]


FULL_SHAPES = [("Qwen2.5-1.5B", 4, 1280)]   # the real run's micro-batch (minutes per trace on a CPU)


def features(cfg: dict, tokens: int, chunk_tokens: int = 512) -> list[float]:
    """The plan's terms (preflight.UPDATE_FIT): n · h · L, n · I · L, n · V, C · V, P."""
    from harness.preflight import n_params

    h, L, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    return [tokens * h * L, tokens * inter * L, tokens * v, chunk_tokens * v, n_params(cfg)]


def fit_constants(points: list[tuple[dict, int, int]], full_weight: float = 10.0) -> tuple[tuple, float]:
    """Least squares of (traced peak − 16 bytes per parameter) on `features`, relative to each peak (so small and
    full-size traces count alike; a full-size point weighs `full_weight`). points: (cfg, tokens, peak bytes).
    Returns (constants, largest relative error of the fitted plan against a point's peak)."""
    import numpy as np

    from harness.preflight import n_params

    X = np.array([features(c, n) for c, n, _ in points], float)
    peak = np.array([t for _, _, t in points], float)
    y = peak - 16 * np.array([n_params(c) for c, _, _ in points], float)
    w = np.array([full_weight if n_params(c) > 1e8 else 1.0 for c, _, _ in points]) / peak
    coef = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
    return tuple(round(float(c), 3) for c in coef), float(np.max(np.abs(X @ coef - y) / peak))


def fit(full: bool, verbose: bool = True) -> dict:
    """Trace FIT_SHAPES (and with `full` the FULL_SHAPES) with and without checkpointing; fit preflight's
    UPDATE_FIT and PRM_FIT."""
    import numpy as np

    from harness.preflight import model_config

    out = {}
    shapes = [({**SMALL, **change}, rows, tokens) for change, rows, tokens in FIT_SHAPES]
    if full:
        shapes += [(model_config(name), rows, tokens) for name, rows, tokens in FULL_SHAPES]
    for ckpt in (False, True):
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
    X, y = [], []
    for cfg, rows, tokens in shapes[:len(FIT_SHAPES)]:
        peak = trace_prm(cfg, rows, tokens)
        X.append([rows * tokens * cfg["hidden_size"], rows * tokens * cfg["vocab_size"]])
        y.append(peak["total"] - peak.get("parameter", 0))
    out["prm"] = tuple(round(float(c), 3) for c in np.linalg.lstsq(np.array(X, float), np.array(y, float), rcond=None)[0])
    return out


# ------------------------------------------------------------------------------------------- traced vs planned
def compare(args) -> None:
    """Trace the run's update micro-batches and PRM batch at the real shapes; print them beside the plan."""
    from harness import preflight

    cfg = preflight.model_config(args.model)
    if cfg is None:
        raise SystemExit(f"--model {args.model}: no config (not local, not cached, not an alias)")
    p, T = preflight.n_params(cfg), preflight.PROMPT_TOKENS + args.max_new_tokens
    gib = preflight.CARD_GIB[80]
    rows, _ = preflight.memory_plan(args, gib, use_vllm=True)
    planned = {r: g for r, g, _ in rows}
    print(f"policy {args.model} ({p / 1e9:.2f} B params), micro-batch {args.micro_batch_size} x {T} tokens, "
          f"checkpointing {'on' if args.gradient_checkpointing else 'off'}, log-prob chunk {args.logprob_chunk}")
    t0 = time.time()
    peak = trace_update(cfg, args.micro_batch_size, T, checkpointing=args.gradient_checkpointing,
                        chunk_tokens=args.logprob_chunk, entropy_coef=args.entropy_coef)
    plan_update = 16 * p + preflight.update_extra_bytes(cfg, args.micro_batch_size * T, args.gradient_checkpointing,
                                                        args.logprob_chunk)
    print(f"  traced in {time.time() - t0:.0f} s; peak by category (GiB): "
          + ", ".join(f"{k} {v / GIB:.2f}" for k, v in peak.items() if v))
    print(f"  {'component':58} {'traced':>8} {'planned':>8}")
    print(f"  {'update peak: weights + AdamW + grads + activations/temps':58} {peak['total'] / GIB:8.2f} "
          f"{plan_update / GIB:8.2f}   ({(plan_update / peak['total'] - 1):+.1%})")
    if args.prm != "none":
        prm_cfg = preflight.model_config(args.prm)
        t0 = time.time()
        ppeak = trace_prm(prm_cfg, 4, T)
        plan_prm = 2 * preflight.n_params(prm_cfg) + preflight.prm_scoring_bytes(prm_cfg, 4 * T)
        print(f"  {'PRM ' + args.prm + ' scoring 4 x ' + str(T) + ' tokens (weights + activations)':58} "
              f"{ppeak['total'] / GIB:8.2f} {plan_prm / GIB:8.2f}   ({(plan_prm / ppeak['total'] - 1):+.1%}; "
              f"traced in {time.time() - t0:.0f} s)")
    for row, g, phase in rows:
        if row.startswith(("rollout", "refiner", "CUDA")):
            print(f"  {row[:58]:58} {'-':>8} {g:8.2f}   (not traced: {'a vLLM reservation' if 'CUDA' not in row else 'not tensors'})")
    print(preflight.format_plan(args, rows, [], gib))


# ------------------------------------------------------------------------------------------- update time, for real
def time_update(args, rows: int, tokens: int, repeats: int) -> None:
    """grpo.update for real on the CPU (random weights of --model's config, float32, AdamW), with and without
    gradient checkpointing, alternating, `repeats` timed steps each after one untimed warm-up; medians."""
    import statistics

    import grpo
    from harness import preflight

    torch.manual_seed(0)
    cfg = preflight.model_config(args.model)
    model = fake_model(cfg).train()   # outside FakeTensorMode: a real, randomly initialised model
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
                print(f"  step {k} checkpointing {'on ' if ckpt else 'off'}: {times[ckpt][-1]:.2f} s", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}-shaped policy, {rows} x {tokens} tokens, micro-batch {args.micro_batch_size}, "
          f"{torch.get_num_threads()} threads: median update {off:.2f} s without checkpointing, {on:.2f} s with "
          f"({on / off - 1:+.0%})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="trace the small shapes and print the plan's constants")
    parser.add_argument("--full", action="store_true", help="with --fit: also trace Qwen2.5-1.5B's micro-batch")
    parser.add_argument("--time-update", metavar="ROWSxTOKENS", default="",
                        help="time grpo.update for real on the CPU, with and without checkpointing (e.g. 2x160)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per setting with --time-update")
    known, rest = parser.parse_known_args(argv)
    if known.fit:
        print(json.dumps(fit(known.full), indent=1))
        return
    import scope

    args = scope.parse_args(rest)
    if known.time_update:
        rows, tokens = (int(x) for x in known.time_update.lower().split("x"))
        time_update(args, rows, tokens, known.repeats)
        return
    compare(args)


if __name__ == "__main__":
    main()
