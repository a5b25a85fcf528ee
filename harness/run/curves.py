"""curves.py — the training curves of one or more runs as one PNG, from their metrics.jsonl (paper Figs. 3-7).

A finished run draws its own (harness/run/progress.py, `closing_outputs`: runs/<name>/curves.png); `python -m
tools.report --plot RUN [RUN ...]` draws several side by side.
"""
import json
import os


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file; a bad line raises ValueError naming the file and line number."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {line_no}: not valid JSON ({err})") from err
    return records


def run_file(run: str, name: str) -> str:
    """runs/A -> runs/A/<name>; a file path is taken as is. FileNotFoundError names what is missing."""
    path = os.path.join(run, name) if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected a run directory holding {name}, or the file)")
    return path


def _field(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _acceptance(row: dict) -> float | None:
    tried, accepted = _field(row, "rectify_tried"), _field(row, "rectify_accepted")
    return accepted / tried if tried and accepted is not None else None


# (panel title, value of one metrics.jsonl row or None when the row lacks it)
PLOT_PANELS = [
    ("reward (mean)", lambda row: _field(row, "reward_mean")),
    ("eval accuracy", lambda row: _field(row, "eval_acc")),
    ("keep ratio (steps)", lambda row: _field(row, "keep_ratio_steps")),
    ("rectification acceptance", _acceptance),
    ("entropy", lambda row: _field(row, "entropy")),
    ("response length (tokens)", lambda row: _field(row, "response_len")),
    ("near-miss share (r=0)", lambda row: _field(row, "near_miss_frac")),
    ("discarded valid share (r=0)", lambda row: _field(row, "discarded_valid_frac")),
]


def plot_runs(runs: list[str], out: str) -> str:
    """One PNG with the training curves of several runs side by side (paper Figs. 3-7), from each run's
    metrics.jsonl. x = "step" (the row index when absent); rows without a field are skipped; a panel no
    run has data for says so. Returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {}
    for run in runs:
        path = run_file(run, "metrics.jsonl")
        logs[os.path.basename(os.path.dirname(os.path.abspath(path)))] = read_jsonl(path)  # label: run dir name
    cols = 4
    fig, axes = plt.subplots((len(PLOT_PANELS) + cols - 1) // cols, cols,
                             figsize=(4.5 * cols, 3.4 * ((len(PLOT_PANELS) + cols - 1) // cols)), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(logs)}  # one colour per run in every panel
    for ax, (title, value) in zip(axes.flat, PLOT_PANELS):
        any_data = False
        for label, rows in logs.items():
            points = [(row.get("step", i), value(row)) for i, row in enumerate(rows)]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                any_data = True
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) <= 30 else None, markersize=3, color=colors[label])
        if not any_data:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PLOT_PANELS):]:
        ax.axis("off")
    # one legend naming every run (a run without data in the first panel, e.g. grpo's keep ratio, still gets its
    # entry; regression: per-panel colour cycles used to shift and the legend then mislabelled later panels)
    handles = [plt.Line2D([], [], color=colors[label], label=label) for label in logs]
    if handles:
        axes.flat[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
