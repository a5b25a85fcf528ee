"""report.py — what a training run left, for a person to look at: its curves and its rectifications.

Reads a run folder written by scope.py (runs/<name>/metrics.jsonl and traces.jsonl); trains and evaluates
nothing (the paper's evaluation is eval.py). Two views:

 1. `--plot RUN [RUN ...]`: one PNG with the training curves of the runs side by side (paper Figs. 3-7:
    reward, held-out accuracy, keep ratio, acceptance, entropy, length, near-miss and discarded-valid
    shares; drawn by harness/run/curves.py, as a finished run draws its own). Written next to the run
    (runs/<name>/curves.png; several runs: runs/curves_<a>_<b>.png) unless --out names the file.
 2. `--trace RUN [--step N] [--html [FILE]]`: the rectifications of one step (the last one with any by
    default) as the paper's Fig. 12: the policy's steps with their PRM scores, the cut, each refiner
    attempt. `--html` also writes a self-contained page (default runs/<name>/trace_step<N>.html).
    A --step outside the steps the run trained is refused with the range.

How to run (from the repository root):
  python -m tools.report --plot runs/scope-toy-s0 runs/grpo-toy-s0
  python -m tools.report --trace runs/scope-toy-s0 --step 30 --html
"""
import argparse
import html
import os
import sys

from harness.run.curves import plot_runs, read_jsonl, run_file

ANSI = {"green": "\033[32m", "red": "\033[31m", "blue": "\033[34m", "dim": "\033[2m", "bold": "\033[1m"}


def _paint(text: str, style: str, color: bool) -> str:
    """Wrap each line in an ANSI style (per line, so pagers like `less -R` keep it)."""
    if not color:
        return text
    return "\n".join(f"{ANSI[style]}{line}\033[0m" for line in text.split("\n"))


def _printable(text: str) -> str:
    """Model text made safe for a terminal: control characters (an ESC could recolour or move the cursor)
    shown as \\xNN, newlines and tabs kept."""
    return "".join(c if c in "\n\t" or (c >= " " and c != "\x7f") else f"\\x{ord(c):02x}" for c in str(text))


def _indent(text: str, prefix: str = "    ") -> str:
    lines = _printable(text).strip("\n").split("\n")
    return "\n".join(prefix + line if line.strip() else "" for line in lines)


def _attempt_labels(record: dict) -> list[str]:
    """'correct' / 'wrong' per refiner attempt; the first correct one of an accepted record is the one kept."""
    correct = record.get("attempt_correct") or []
    n_attempts = len(record.get("suffixes") or [])
    labels = ["correct" if j < len(correct) and correct[j] else "wrong" for j in range(n_attempts)]
    if record.get("accepted") and "correct" in labels:
        labels[labels.index("correct")] = "correct, accepted"
    return labels


def _score(score) -> str:
    return "  -  " if score is None else f"{score:.2f}"


def _ratio(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def render_trace_text(record: dict, color: bool = False) -> str:
    """One rectification (a traces.jsonl record) for the terminal, as in the paper's Fig. 12: the
    policy's steps with their PRM scores (green = kept, red = the first step not kept, dim = discarded),
    the cut, then each refiner attempt (blue) marked correct or not."""
    steps, scores, cut = record.get("steps") or [], record.get("scores") or [], record.get("cut") or 0
    verdict = "ACCEPTED" if record.get("accepted") else "rejected"
    out = [_paint(f"== step {record.get('step', '?')} | group {record.get('group', '?')} | "
                  f"mode {record.get('mode', 'scope')} | {verdict} | reward {record.get('reward_before', '?')}"
                  f" -> {record.get('reward_after', '?')} | kept {cut}/{len(steps)} steps "
                  f"(keep ratio {_ratio(record.get('keep_ratio'))}, tokens "
                  f"{_ratio(record.get('keep_ratio_tokens'))})", "bold", color),
           "question:", _indent(record.get("question", "")),
           f"gold answer: {_printable(record.get('answer', ''))}",
           "policy steps [PRM score]:"]
    for i, step in enumerate(steps):
        score = scores[i] if i < len(scores) else None
        if i == cut:
            out.append(_paint("  ---- cut: the refiner rewrites from here ----", "bold", color))
        tag, style = ("kept", "green") if i < cut else ("FIRST ERROR", "red") if i == cut else ("discarded", "dim")
        out.append(_paint(f"  [{_score(score)}] {tag}\n{_indent(step)}", style, color))
    if cut >= len(steps):
        out.append(_paint("  ---- cut: the refiner continues after the last step ----", "bold", color))
    for j, (suffix, label) in enumerate(zip(record.get("suffixes") or [], _attempt_labels(record))):
        out.append(_paint(f"  refiner attempt {j + 1} ({label}):\n{_indent(suffix)}", "blue", color))
    return "\n".join(out) + "\n"


HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;color:#222}
section{border:1px solid #ccc;border-radius:6px;padding:1rem;margin-bottom:1.5rem}
.step,.refined{white-space:pre-wrap;font-family:monospace;padding:.3rem .5rem;margin:.2rem 0;border-radius:4px}
.kept{background:#e6f4ea;border-left:4px solid #2e7d32}.error{background:#fdecea;border-left:4px solid #c62828}
.discarded{color:#888;background:#f5f5f5;border-left:4px solid #bbb}
.refined{background:#e8f0fe;border-left:4px solid #1a56db}.score{font-weight:bold;margin-right:.6rem}
.cut{color:#c62828;font-weight:bold;margin:.4rem 0}.q{white-space:pre-wrap}"""


def render_traces_html(records: list[dict], title: str = "SCOPE rectifications") -> str:
    """A self-contained HTML page of rectifications (inline CSS, no scripts); all model text is escaped."""
    def esc(value) -> str:
        return html.escape(str(value).strip("\n"), quote=True)

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{HTML_STYLE}</style></head><body><h1>{esc(title)}</h1>"]
    for rec in records:
        steps, scores, cut = rec.get("steps") or [], rec.get("scores") or [], rec.get("cut") or 0
        parts.append(f"<section><h2>step {esc(rec.get('step', '?'))}, group {esc(rec.get('group', '?'))}: "
                     f"{'accepted' if rec.get('accepted') else 'rejected'}</h2>"
                     f"<p>mode {esc(rec.get('mode', 'scope'))}; reward {esc(rec.get('reward_before', '?'))} "
                     f"&rarr; {esc(rec.get('reward_after', '?'))}; kept {cut}/{len(steps)} steps "
                     f"(keep ratio {_ratio(rec.get('keep_ratio'))}, "
                     f"tokens {_ratio(rec.get('keep_ratio_tokens'))})</p>"
                     f"<p><b>Question</b></p><div class='q'>{esc(rec.get('question', ''))}</div>"
                     f"<p><b>Gold answer:</b> {esc(rec.get('answer', ''))}</p>")
        for i, step in enumerate(steps):
            if i == cut:
                parts.append("<div class='cut'>&#9986; cut: the refiner rewrites from here</div>")
            kind = "kept" if i < cut else "error" if i == cut else "discarded"
            score = scores[i] if i < len(scores) else None
            parts.append(f"<div class='step {kind}'><span class='score'>{esc(_score(score))}</span>"
                         f"{esc(step)}</div>")
        if cut >= len(steps):
            parts.append("<div class='cut'>&#9986; cut: the refiner continues after the last step</div>")
        for j, (suffix, label) in enumerate(zip(rec.get("suffixes") or [], _attempt_labels(rec))):
            parts.append(f"<p>refiner attempt {j + 1} ({label})</p><div class='refined'>{esc(suffix)}</div>")
        parts.append("</section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def select_traces(records: list[dict], step: int | None) -> list[dict]:
    """The records of training step `step`; without one, those of the last step that has any."""
    if not records:
        return []
    if step is None:
        step = max(r.get("step", 0) for r in records)
    return [r for r in records if r.get("step", 0) == step]


def runs_label(paths: list[str]) -> str:
    return "_".join(os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths)


def plot_path(runs: list[str]) -> str:
    """Where --plot writes without --out: runs/<name>/curves.png for one run; runs/curves_<a>_<b>.png (beside
    the first run's folder) for several."""
    paths = [run_file(run, "metrics.jsonl") for run in runs]
    first = os.path.dirname(os.path.abspath(paths[0]))
    if len(paths) == 1:
        return os.path.join(os.path.relpath(first), "curves.png")
    return os.path.join(os.path.relpath(os.path.dirname(first)), f"curves_{runs_label(paths)}.png")


def trained_steps(run_dir: str) -> list[int]:
    """The training steps a run logged (metrics.jsonl), [] when it has no metrics."""
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r["step"] for r in read_jsonl(path) if r.get("step", 0) >= 1] if os.path.isfile(path) else []


def show_traces(run: str, *, step: int | None, limit: int | None, html_out: str | None, color: bool) -> None:
    """Print the rectifications of one training step of a run (and write them as HTML when asked). A step the
    run did not train raises ValueError naming the range."""
    path = run_file(run, "traces.jsonl")
    run_dir = os.path.relpath(os.path.dirname(os.path.abspath(path)))
    records, steps = read_jsonl(path), trained_steps(run_dir)
    if step is not None and steps and not min(steps) <= step <= max(steps):
        raise ValueError(f"--step {step}: {run_dir} trained steps {min(steps)}-{max(steps)}")
    chosen = select_traces(records, step)[:limit]
    if not records:
        print(f"no rectification traces in {run_dir}: it repaired nothing (a --mode grpo or prm-reward run, "
              f"or no failure was rectified)")
    elif not chosen:
        with_traces = sorted({r.get("step", 0) for r in records})
        print(f"no rectification at step {step} of {run_dir}; steps with traces: "
              f"{', '.join(map(str, with_traces[:20]))}{' ...' if len(with_traces) > 20 else ''}")
    if chosen:   # which step this is, and where the others are
        with_traces = sorted({r.get("step", 0) for r in records})
        shown = chosen[0].get("step", 0)
        others = [s for s in with_traces if s != shown]
        listed = ", ".join(map(str, others[:10])) + (f" ... {others[-1]}" if len(others) > 10 else "")
        print(f"step {shown} of {run_dir}{' (the last with repairs)' if step is None else ''}: {len(chosen)} "
              f"rectification(s)" + (f"; other steps with repairs: {listed} (--step N shows one)" if others else ""))
    for record in chosen:
        print(render_trace_text(record, color=color))
    if html_out is not None and chosen:
        out = html_out or os.path.join(run_dir, f"trace_step{chosen[0].get('step', 0)}.html")
        with open(out, "w", encoding="utf-8") as f:
            f.write(render_traces_html(chosen, title=f"SCOPE rectifications: {run_dir}"))
        print(f"wrote {out}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.report", description="Training curves and rectification "
                                "traces of scope.py runs.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--plot", nargs="+", metavar="RUN", help="run folders (or metrics.jsonl files) to plot")
    what.add_argument("--trace", metavar="RUN", help="run folder (or traces.jsonl) whose rectifications to show")
    p.add_argument("--out", help="with --plot: the PNG (default: next to the run, see above)")
    p.add_argument("--step", type=int, default=None, help="with --trace: training step (default: the last with traces)")
    p.add_argument("--limit", type=int, default=None, help="with --trace: show at most K traces")
    p.add_argument("--html", nargs="?", const="", default=None, metavar="FILE",
                   help="with --trace: also write a self-contained HTML page (default: RUN/trace_step<N>.html)")
    p.add_argument("--no-color", action="store_true", help="with --trace: no ANSI colours")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.plot:
            print(f"wrote {plot_runs(args.plot, args.out or plot_path(args.plot))}")
        else:
            show_traces(args.trace, step=args.step, limit=args.limit, html_out=args.html,
                        color=sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ)
    except (OSError, ValueError) as err:  # missing files, bad rows, a step the run never trained: one line
        print(f"report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
