"""check.py — what .ci/gpu_check.sh runs outside pytest: the part "co-run", the shapes and builders the parts
share, and the projection of each run's seconds on an H200 (docs/gpu-check.md).

Part "co-run" (the design measurement, torch only): can one GPU decode and train at once? A 7B-shaped bf16 decoder
(random weights, built here: Qwen2.5-Math-7B's layers, no rotary embedding, greedy) decodes 32 sequences x 640
tokens from a 150-token context with a static KV cache (one CUDA graph per decode step on CUDA); one full-size
grpo.update at Qwen2.5-1.5B's shape (128 rows of 256 + up to 1,024 tokens). Each alone, then both at once, in three
interleaved rounds (medians):  eta = (T_update + T_decode - T_both) / min(T_update, T_decode)  (0: they time-slice;
1: the shorter one is free). Measured twice:
  - eta (processes): decode and update in two processes, as the trainer and its `vllm serve` refiner run. Without
    MPS two processes time-slice, so this is eta (no MPS, time-slicing), about 0; under MPS it is eta (MPS), the
    figure steptime's Hardware.corun assumes. It starts no MPS daemon and changes no GPU setting: it says whether
    MPS ran, and labels the figure by it.
  - eta (streams): both in ONE process, the decode's CUDA graph replayed from a second thread on its own CUDA
    stream beside the update on the main thread's: what the hardware overlaps with no MPS and no second process,
    an upper bound for eta (MPS).

    python -m tools.gpu.check corun                  # on a CUDA machine: the real shapes
    python -m tools.gpu.check corun --tiny           # tiny shapes on the CPU: the orchestration only
    python -m tools.gpu.check project FIGURES.jsonl  # the H200 seconds of each run from the parts' measured ones
"""
import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  vocab_size=151936, tie_word_embeddings=True, hidden_act="silu")
QWEN25_MATH_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, vocab_size=152064)
TINY_UPDATE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=256, vocab_size=1200, tie_word_embeddings=True)
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1200)
MPS_PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")   # nvidia-cuda-mps-control -d: its pipe


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon is listening on its default pipe (or $CUDA_MPS_PIPE_DIRECTORY)."""
    return os.path.exists(os.path.join(MPS_PIPE, "control"))


# ------------------------------------------------------------------------------ the update the parts time and trace
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


def default_step_batch(rows: int, prompt: int, max_new: int, vocab: int, device: str) -> dict:
    """A default step's batch: `rows` rows of `prompt` tokens and a response of random length up to `max_new`."""
    rng = random.Random(0)
    lengths = [prompt + rng.randint(max_new // 8, max_new) for _ in range(rows)]
    return random_batch(rows, prompt + max_new, prompt, vocab, device, lengths)


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
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else contextlib.nullcontext


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ the 7B-shaped decoder of "co-run"
class StaticDecoder(torch.nn.Module):
    """A Qwen2-shaped decoder (`shape`: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, vocab_size) with random weights and a static KV cache of `batch` x `context` tokens. `step`
    decodes one greedy token per sequence in place (tokens, position and cache are buffers), so one CUDA graph of it
    replays the whole decode. No rotary embedding: a few elementwise kernels per layer, not the bytes that bind."""

    def __init__(self, shape: dict, batch: int, context: int, device: str, dtype=torch.bfloat16):
        super().__init__()
        h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        self.heads, self.kv, self.hd = shape["num_attention_heads"], shape["num_key_value_heads"], h // shape[
            "num_attention_heads"]
        new = lambda *size: torch.randn(*size, device=device, dtype=dtype) * 0.02  # noqa: E731
        self.embed, self.head = new(shape["vocab_size"], h), new(shape["vocab_size"], h)
        self.qkv = [new((self.heads + 2 * self.kv) * self.hd, h) for _ in range(layers)]
        self.qkv_bias = [new((self.heads + 2 * self.kv) * self.hd) for _ in range(layers)]
        self.out = [new(h, self.heads * self.hd) for _ in range(layers)]
        self.gate_up = [new(2 * f, h) for _ in range(layers)]
        self.down = [new(h, f) for _ in range(layers)]
        self.k = torch.zeros(layers, batch, self.kv, context, self.hd, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)   # (B,) the last token of each sequence
        self.pos = torch.zeros(1, dtype=torch.long, device=device)          # the position being written
        self.cols = torch.arange(context, device=device)

    def start(self, prompt: int) -> None:
        """Sequences with a `prompt`-token context (random keys and values) and token 0 to continue from."""
        self.k[:, :, :, :prompt].normal_()
        self.v[:, :, :, :prompt].normal_()
        self.tokens.zero_()
        self.pos.fill_(prompt)

    @staticmethod
    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    @torch.no_grad()
    def step(self) -> None:
        B = self.tokens.shape[0]
        x = self.embed[self.tokens]   # (B, h)
        visible = (self.cols <= self.pos).view(1, 1, 1, -1)   # (1, 1, 1, C)
        for layer in range(len(self.qkv)):
            qkv = torch.nn.functional.linear(self.rms(x), self.qkv[layer], self.qkv_bias[layer])
            q, k, v = qkv.split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
            self.k[layer].index_copy_(2, self.pos, k.view(B, self.kv, 1, self.hd))
            self.v[layer].index_copy_(2, self.pos, v.view(B, self.kv, 1, self.hd))
            q = q.view(B, self.kv, self.heads // self.kv, self.hd)   # (B, kv, g, d): grouped-query attention
            scores = (q @ self.k[layer].transpose(-1, -2)).float() / self.hd ** 0.5   # (B, kv, g, C)
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(x.dtype)
            x = x + torch.nn.functional.linear((weights @ self.v[layer]).reshape(B, -1), self.out[layer])
            gate, up = torch.nn.functional.linear(self.rms(x), self.gate_up[layer]).chunk(2, dim=-1)
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down[layer])
        self.tokens.copy_((self.rms(x) @ self.head.T).argmax(-1))
        self.pos.add_(1)


def decode_role(device: str, tiny: bool, stream=None):
    """(warm-up, one timed run) of the decode process: 32 x 640 tokens (tiny: 4 x 16) from a 150-token context.
    `stream`: the CUDA stream the run replays on, waiting for that stream only (None: the current one, and the
    whole device)."""
    shape, batch, prompt, new = (TINY_DECODER, 4, 8, 16) if tiny else (QWEN25_MATH_7B, 32, 150, 640)
    model = StaticDecoder(shape, batch, prompt + new + 1, device, torch.float32 if device == "cpu" else torch.bfloat16)
    replay = model.step
    if device == "cuda":   # one CUDA graph of a decode step, captured after warm-up steps on a side stream
        model.start(prompt)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        model.start(prompt)
        with torch.cuda.graph(graph):
            model.step()
        replay = graph.replay

    def run():
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            model.start(prompt)
            for _ in range(new):
                replay()
        stream.synchronize() if stream is not None else synchronize(device)
    return run, dict(sequences=batch, tokens=new, params=sum(t.numel() for t in [
        model.embed, *model.qkv, *model.out, *model.gate_up, *model.down]))


def update_role(device: str, tiny: bool):
    """(warm-up, one timed run) of the update process: grpo.update of a default step's batch (tiny: 6 rows)."""
    sys.path.insert(0, ROOT)
    import grpo

    shape, rows, prompt, new = (TINY_UPDATE, 6, 8, 32) if tiny else (QWEN25_15B, 128, 256, 1024)
    model, opt = policy_for_update(shape, device)
    batch = default_step_batch(rows, prompt, new, shape["vocab_size"] - 1000, device)

    def run():
        grpo.update(model, opt, batch, micro_batch_size=4, max_new_tokens=new, chunk_tokens=512, amp=amp_of(device))
        synchronize(device)
    return run, dict(rows=rows, tokens=int(batch["attention_mask"].sum()))


def serve_role(role: str, device: str, tiny: bool) -> None:
    """A co-run worker: build, warm up once, print `ready {facts}`; then each `go` line runs once and prints
    `done SECONDS`; `quit` (or the end of stdin) ends it."""
    run, facts = (decode_role if role == "decode" else update_role)(device, tiny)
    run()
    print("ready", json.dumps(facts), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        run()
        print(f"done {time.perf_counter() - t0:.4f}", flush=True)


def eta(t_a: float, t_b: float, t_both: float) -> float:
    """Co-run efficiency: (T_a + T_b - T_both) / min(T_a, T_b); 0 when the two time-slice, 1 when the shorter is free."""
    return round((t_a + t_b - t_both) / min(t_a, t_b), 3)


def eta_label(mps: bool) -> str:
    """What eta (processes) measures: under MPS the figure Hardware.corun stands for, else time-slicing."""
    return "η (MPS)" if mps else "η (no MPS, time-slicing)"


def corun(device: str, tiny: bool, repeats: int = 3, timeout: float = 300, log_dir: str | None = None) -> dict:
    """Part "co-run": eta (processes), then eta (streams) (`corun_streams`), both within `timeout` seconds. Both
    workers built and warm, then `repeats` interleaved rounds of (decode alone, update alone, both at once), the
    medians: eta and each one's slowdown. Each worker is its own process, ended here whatever happens; its stderr
    streams to `log_dir`/corun_<role>.log (None: a temporary file); a worker that ends or says nothing by the
    deadline (a silent stall included) is one RuntimeError with its last words."""
    import queue
    import statistics
    import threading

    env = {**os.environ, "PYTHONPATH": ROOT}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    # a file, not a pipe (a full pipe would block), on disk as the worker writes
    errs = {role: open(os.path.join(log_dir, f"corun_{role}.log"), "w+") if log_dir else tempfile.TemporaryFile("w+")
            for role in ("decode", "update")}
    procs = {role: subprocess.Popen([sys.executable, "-m", "tools.gpu.check", "serve", role, "--device", device]
                                    + (["--tiny"] if tiny else []), cwd=ROOT, env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[role])
             for role in ("decode", "update")}
    deadline = time.time() + timeout
    lines = {role: queue.Queue() for role in procs}   # each worker's stdout lines, read by a thread ("" at its end)

    def pump(role):
        for line in procs[role].stdout:
            lines[role].put(line)
        lines[role].put("")

    for role in procs:
        threading.Thread(target=pump, args=(role,), daemon=True, name=f"co-run {role} stdout").start()

    def read(role):
        try:
            line = lines[role].get(timeout=max(deadline - time.time(), 0.01))
        except queue.Empty:
            line = ""
        if not line:
            if procs[role].poll() is None:   # stalled: it has nothing more to say
                procs[role].kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[role].wait(timeout=10)            # an ended worker: its exit code and its last words
            errs[role].seek(0)
            tail = " | ".join(ln.strip()[:160] for ln in errs[role].read().strip().splitlines()[-2:])
            said = "ended" if time.time() < deadline else f"said nothing within {timeout:g} s"
            raise RuntimeError(f"co-run: the {role} worker {said} (exit {procs[role].poll()}): {tail}")
        return line.split(" ", 1)

    def go(*roles):
        t0 = time.perf_counter()
        for role in roles:
            procs[role].stdin.write("go\n")
            procs[role].stdin.flush()
        own = {role: float(read(role)[1]) for role in roles}
        return time.perf_counter() - t0, own

    ended = False
    try:
        facts = {}
        for role in procs:
            kind, rest = read(role)
            assert kind == "ready", (role, kind)
            facts[role] = json.loads(rest)
        rounds = [(go("decode")[1]["decode"], go("update")[1]["update"], go("decode", "update"))
                  for _ in range(repeats)]   # interleaved: a drift of the machine reaches all three alike
        alone = {"decode": statistics.median(r[0] for r in rounds), "update": statistics.median(r[1] for r in rounds)}
        t_both = statistics.median(r[2][0] for r in rounds)
        inside = {role: statistics.median(r[2][1][role] for r in rounds) for role in procs}
        ended = True
    finally:
        for p in procs.values():
            with contextlib.suppress(OSError, ValueError):
                p.stdin.write("quit\n")
                p.stdin.close()
        for p in procs.values():
            try:
                p.wait(timeout=30 if ended else 1)   # after a failure the other worker is not waited for
            except subprocess.TimeoutExpired:
                p.kill()
        for f in errs.values():
            f.close()
    t_dec, t_upd = alone["decode"], alone["update"]
    mps = mps_running()
    return dict(part="co-run", device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                mps=mps, eta_label=eta_label(mps), repeats=repeats, decode_seconds=round(t_dec, 4),
                update_seconds=round(t_upd, 4), both_seconds=round(t_both, 4), eta=eta(t_dec, t_upd, t_both),
                decode_slowdown=round(inside["decode"] / t_dec, 3), update_slowdown=round(inside["update"] / t_upd, 3),
                decode=facts["decode"], update=facts["update"],
                streams=corun_streams(device, tiny, repeats, max(deadline - time.time(), 10)))


def corun_streams(device: str, tiny: bool, repeats: int = 3, timeout: float = 300) -> dict:
    """eta (streams): the decode and the update of `corun` in this one process, the decode replayed from a second
    thread on its own CUDA stream while the main thread runs the update on its stream; both warm, then `repeats`
    interleaved rounds of (decode alone, update alone, both at once), the medians. A decode thread still running
    after `timeout` is one RuntimeError."""
    import statistics
    import threading

    side = torch.cuda.Stream() if device == "cuda" else None
    decode, _ = decode_role(device, tiny, stream=side)
    update, _ = update_role(device, tiny)
    decode()
    update()
    deadline = time.time() + timeout

    def timed(*runs):
        synchronize(device)
        t0 = time.perf_counter()
        if len(runs) == 1:
            runs[0]()
        else:
            errors = []

            def decode_beside():
                try:
                    decode()
                except BaseException as err:   # raised in the main thread below
                    errors.append(err)
            worker = threading.Thread(target=decode_beside, name="co-run decode", daemon=True)
            worker.start()
            update()
            worker.join(timeout=max(deadline - time.time(), 0.01))
            if worker.is_alive():
                raise RuntimeError(f"co-run (streams): the decode thread still runs after {timeout:g} s")
            if errors:
                raise RuntimeError(f"co-run (streams): the decode thread failed: {errors[0]!r}") from errors[0]
        synchronize(device)
        return time.perf_counter() - t0

    rounds = [(timed(decode), timed(update), timed(decode, update)) for _ in range(repeats)]
    t_dec, t_upd, t_both = (statistics.median(r[k] for r in rounds) for k in range(3))
    return dict(label="η (streams)", decode_seconds=round(t_dec, 4), update_seconds=round(t_upd, 4),
                both_seconds=round(t_both, 4), eta=eta(t_dec, t_upd, t_both))


# ------------------------------------------------------------------------------ the projection of the two runs
RUNS = {"correctness": ("run", "update-peak", "update-time", "prm-time", "vllm"), "design": ("small-card", "co-run")}
CUDA_START = 20.0    # s per part process on a GPU machine: python, torch and transformers imports, the CUDA context
DISK_RATE = 1.0e9    # bytes/s a part's files are written and read back at (a cloud disk's sustained rate)


def h200_seconds(part: dict) -> float:
    """One part's projected H200 seconds: its measured CPU seconds at the tiny shapes stand for the orchestration
    (imports, processes, bookkeeping), plus the CUDA start, the bytes it writes at the real shape over DISK_RATE,
    and its GPU work at the real shape from harness/plan/steptime.py's H200 (rates, MFU, bandwidth)."""
    from harness.plan import steptime

    hw, p15, p7 = steptime.H200, steptime.POLICY.params, steptime.REFINER.params
    train = lambda tokens, steps: steps * 8 * p15 * tokens / (hw.flops * hw.train_mfu)  # noqa: E731  checkpointing
    decode = lambda params, steps: steps * (hw.decode_overhead + 2 * params / (hw.bandwidth * hw.decode_bw))  # noqa
    work = {"update-peak": train(8 * 1280, 2),
            "update-time": train(128 * (256 + 576), 2),
            "prm-time": 2 * steptime.PRM.params * 64 * 1280 / (hw.flops * 0.30),   # HF eager forward, bf16
            # two scope.py children (SCOPE, GRPO) of 2 steps: HF generate of 64 tokens at ~30 ms a step (eager
            # Python over 28 layers), a tiny update, the policy loaded from disk
            "run": 2 * 2 * (64 * 0.030 + train(16 * 100, 2)),
            "vllm": 60.0,   # the engine's start (compile, CUDA graphs) on a tiny model
            # twice (processes, streams): a warm-up, then 3 rounds of each alone and both at once
            "co-run": 2 * 7 * (decode(p7, 640) + train(128 * (256 + 576), 1)),
            # one scope.py step of 4 x 4 rollouts: HF generate of 1,024 tokens and a policy refiner of 640 at ~30 ms
            # a token, a LoRA update of 16 rows (a third of the full update's FLOPs: no weight gradients)
            "small-card": (1024 + 640) * 0.030 + train(16 * 1280, 1) / 3}[part["part"]]
    return part["cpu_seconds"] + CUDA_START + part.get("bytes_real", 0) * 2 / DISK_RATE + work


def projection(parts: list[dict]) -> dict[str, float]:
    """{run: projected H200 seconds} over the parts of each run that were measured."""
    return {run: round(sum(h200_seconds(p) for p in parts if p["part"] in names), 1) for run, names in RUNS.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corun", help="part co-run: eta of a 7B decode beside a full-size update")
    c.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the orchestration only)")
    s = sub.add_parser("serve", help="one co-run worker (started by `corun`)")
    s.add_argument("role", choices=("decode", "update"))
    s.add_argument("--device", default="cuda")
    s.add_argument("--tiny", action="store_true")
    p = sub.add_parser("project", help="each run's projected H200 seconds from the parts' figures")
    p.add_argument("figures")
    args = ap.parse_args(argv)
    if args.command == "serve":
        serve_role(args.role, args.device, args.tiny)
    elif args.command == "corun":
        device = "cpu" if args.tiny else "cuda"
        print(json.dumps(corun(device, args.tiny)))
    else:
        parts = [json.loads(line) for line in open(args.figures, encoding="utf-8") if line.strip()]
        print(json.dumps(projection(parts)))


if __name__ == "__main__":
    main()
