"""phase_memory.py — each phase's peak GPU memory, measured, next to the memory plan's figure for that phase.

The pre-flight plans the memory of a run before it starts (harness/plan/memory.py memory_plan, docs/memory.md); this
checks that plan on every GPU run. Around each phase of a step (rollout, prm, refine, update, sync) the CUDA
allocator's peak is reset and read back (`torch.cuda.max_memory_allocated` and `max_memory_reserved`); the step's
metrics get, per phase, `mem_<phase>_allocated_gib`, `mem_<phase>_reserved_gib` and `mem_<phase>_planned_gib`
(docs/memory.md), and the closing summary names each phase whose largest measured peak is off the plan by more
than 10 %, either way.

What the trainer's allocator sees is the trainer's process: the plan's figure for a phase is the sum of its rows
held then, without the rows of other processes (a refiner or PRM on its own `vllm serve`) and without the CUDA
context (not allocator memory). The in-process vLLM rollout engine's weights and KV cache are counted as planned;
whether the allocator's statistics see vLLM's sleep-mode memory pool is one of the things a GPU run tells.
On the CPU nothing is measured (no records).
"""
import contextlib

from harness.plan.memory import GIB

TOLERANCE = 0.10
UPDATE_PHASES = ("update",)  # the plan's "update" rows are held then; every other phase holds its "other" rows
NOT_IN_PROCESS = ("refiner: its own vllm serve", "PRM: its own vllm serve", "CUDA context")

_state = {"cuda": None, "plan": {}, "record": {}}


def plan_by_phase(rows: list[tuple[str, float, str]]) -> dict[str, float]:
    """{"update": GiB, "other": GiB} of the plan's rows this process's allocator holds (NOT_IN_PROCESS left out)."""
    mine = [(gib, phase) for name, gib, phase in rows if not name.startswith(NOT_IN_PROCESS)]
    base = sum(gib for gib, phase in mine if phase == "all")
    return {kind: base + sum(gib for gib, phase in mine if phase == kind) for kind in ("update", "other")}


def start(rows: list[tuple[str, float, str]], cuda=None) -> None:
    """Measure from now on with `cuda` (torch.cuda on a GPU run; a stand-in in the tests; None: measure nothing)
    against the plan `rows` (memory.memory_plan's)."""
    _state.update(cuda=cuda, plan=plan_by_phase(rows) if rows else {}, record={})


def planned(phase: str) -> float | None:
    return _state["plan"].get("update" if phase in UPDATE_PHASES else "other")


@contextlib.contextmanager
def phase(name: str):
    """Reset the allocator's peak, run the phase, record its peak allocated and reserved GiB."""
    cuda = _state["cuda"]
    if cuda is None:
        yield
        return
    cuda.reset_peak_memory_stats()
    yield
    _state["record"][name] = (cuda.max_memory_allocated() / GIB, cuda.max_memory_reserved() / GIB)


def step_record() -> dict:
    """This step's figures for metrics.jsonl (empty when nothing is measured), then a fresh record."""
    out = {}
    for name, (allocated, reserved) in _state["record"].items():
        out.update({f"mem_{name}_allocated_gib": round(allocated, 3), f"mem_{name}_reserved_gib": round(reserved, 3)})
        if planned(name) is not None:
            out[f"mem_{name}_planned_gib"] = round(planned(name), 3)
    _state["record"] = {}
    return out


def off_plan(records: list[dict], tolerance: float = TOLERANCE) -> list[str]:
    """One line per phase whose largest allocated peak over `records` (metrics.jsonl rows) is more than `tolerance`
    off its planned figure, either way."""
    lines = []
    phases = sorted({k[4:-len("_allocated_gib")] for r in records for k in r
                     if k.startswith("mem_") and k.endswith("_allocated_gib")})
    for name in phases:
        peaks = [r[f"mem_{name}_allocated_gib"] for r in records if f"mem_{name}_allocated_gib" in r]
        plans = [r[f"mem_{name}_planned_gib"] for r in records if f"mem_{name}_planned_gib" in r]
        if not peaks or not plans or plans[-1] <= 0:
            continue
        peak, plan = max(peaks), plans[-1]
        if abs(peak / plan - 1) > tolerance:
            lines.append(f"memory plan off by {peak / plan - 1:+.0%} in the {name} phase: measured peak {peak:.1f} GiB "
                         f"allocated, planned {plan:.1f} GiB (metrics.jsonl: mem_{name}_*)")
    return lines
