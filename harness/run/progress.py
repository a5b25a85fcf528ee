"""progress.py — where a run or a study is, in its log as on a terminal; what a finished run leaves to read.

- `step_line`: the one line a step prints, within 160 characters with its position and ETA (the reward before and
  after repairs, the repairs, the groups without signal, length, entropy, gradient norm, seconds, evaluation);
  `--log-detail` adds the phases' seconds, the loss, the all-failed groups' repairs and their keep ratio, and the
  checkpoint's seconds. metrics.jsonl holds every field either way (docs/metrics.md).
- `StepClock`: the step line's position and ETA ("step 12/30, ETA 1 min 05 s"), from the wall time of the
  steps this process ran (evaluation steps included, so the ETA counts them), printed whether or not a
  terminal is attached: a log file under nohup or SLURM gets the same line. Progress bars (tqdm) are drawn
  only on a terminal (`bar_disabled`): a bar redraws with carriage returns, which a log file keeps as noise.
- `StudyClock`: a study's "run k/N, ETA ..." from the runs that trained or evaluated in this invocation (a
  run already finished and cached counts as done but not into the rate).
- `eval_progress`: where `eval.evaluate` is, a bar on a terminal, one line per generate call in a log.
- `log_rollouts`: a few of each step's sampled rollouts, whole, in rollouts.jsonl beside traces.jsonl (which
  holds the repairs), so what the policy writes can be read in every mode, `--mode grpo` included.
- `closing_outputs` and `summary_to_file`: at the end of a run, its curves picture (curves.png), its model
  folder (model/, harness/run/export.py) and its closing summary as summary.txt, in the run folder, unasked.
"""
import contextlib
import json
import os
import re
import sys
import time

import numpy as np

ROLLOUTS_PER_STEP = 2   # rollouts kept whole per step in rollouts.jsonl


def duration(seconds: float) -> str:
    """45 s, 3 min 05 s, 2 h 07 min."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def bar_disabled(stream=None) -> bool:
    """True off a terminal: a progress bar there would write carriage returns into a log file."""
    stream = stream or sys.stderr
    return not (hasattr(stream, "isatty") and stream.isatty())


def bars_only_on_a_terminal() -> None:
    """Turn off transformers' and huggingface_hub's own progress bars (loading and writing weights) when
    stderr is not a terminal."""
    if bar_disabled():
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def step_line(m: dict, checkpoint_seconds: float | None = None, detail: bool = False) -> str:
    """One step's line from its metrics record `m` (its leading "step N" becomes the position and ETA: StepClock).
    Short: fits 160 characters with a 500-step run's position, an evaluation and 1,024-token answers (the two
    warnings, SKIPPED and REFINER UNAVAILABLE, add to it). `detail` (--log-detail): each number named in full and
    the step's seconds that add up, the phases, the evaluation, "other" (gathering, metrics, the weight push) and
    the checkpoint."""
    if not detail:
        seconds = m["time_step"]
        text = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} → {m['reward_merged']:.3f}, repaired "
                f"{m['rectify_accepted']}/{m['rectify_tried']} | all-fail {m['frac_all_fail']:.2f}, all-pass "
                f"{m['frac_all_pass']:.2f} | length {m['response_len']:.0f}, entropy {m['entropy']:.2f}, grad "
                f"{m['grad_norm']:.2f}{' SKIPPED' if m['skipped'] else ''} | "
                + (f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"))
        text += " | REFINER UNAVAILABLE: no rectification" if m.get("refiner_unavailable") else ""
        return text + (f" | eval {m['eval_acc']:.3f}" if "eval_acc" in m else "")
    kept = m["keep_ratio_steps"]
    text = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f}, after repairs {m['reward_merged']:.3f} | "
            f"groups all failed {m['frac_all_fail']:.2f}, all passed {m['frac_all_pass']:.2f} | "
            f"repaired {m['rectify_accepted']} of {m['rectify_tried']} tried ({m['rectify_all_fail']} in all-failed "
            f"groups{'' if kept is None else f', keeping {kept:.0%} of their steps'}) | "
            f"length {m['response_len']:.0f} tokens, entropy {m['entropy']:.3f} | loss {m['loss']:+.4f}, "
            f"gradient norm {m['grad_norm']:.3f}{' SKIPPED' if m['skipped'] else ''} | {m['time_step']:.1f} s: "
            f"rollout {m['time_rollout']:.1f}, PRM {m['time_prm']:.1f}, refiner {m['time_refine']:.1f}, "
            f"update {m['time_update']:.1f}"
            + (f", eval {m['time_eval']:.1f}" if "time_eval" in m else "")
            + f", other {m['time_step'] - sum(v for k, v in m.items() if k.startswith('time_') and k != 'time_step'):.1f}"
            + ("" if checkpoint_seconds is None else f"; then checkpoint {checkpoint_seconds:.1f} s"))
    text += " | REFINER UNAVAILABLE: no rectification" if m.get("refiner_unavailable") else ""
    return text + (f" | eval accuracy {m['eval_acc']:.3f}" if "eval_acc" in m else "")


class StepClock:
    """The position and ETA of a run's steps: `start_step` is the first step this process runs, `total` the
    last one. ETA = mean wall time per step this process ran × steps left."""

    def __init__(self, start_step: int, total: int, now=time.time):
        self.start_step, self.total, self.now = start_step, total, now
        self.t0 = now()

    def eta(self, step: int) -> float:
        done = step - self.start_step + 1
        return (self.now() - self.t0) / max(done, 1) * (self.total - step)

    def position(self, step: int) -> str:
        """ "step 12/30, ETA 1 min 05 s" (the last step: "step 30/30, done")."""
        width = len(str(self.total))
        left = "done" if step >= self.total else f"ETA {duration(self.eta(step))}"
        return f"step {step:{width}d}/{self.total}, {left}"

    def line(self, text: str, step: int) -> str:
        """A step line whose leading "step N" becomes its position and ETA."""
        return re.sub(r"^step\s+\d+", lambda _: self.position(step), text, count=1)


class StudyClock:
    """A study's runs done out of all, with an ETA; `finished(wall_s)` after each run returns its prefix."""

    def __init__(self, total: int, now=time.time):
        self.total, self.now, self.done, self.fresh = total, now, 0, 0
        self.t0 = now()

    def finished(self, wall_s: float) -> str:
        self.done += 1
        self.fresh += wall_s >= 1.0   # a run already finished and cached takes well under a second
        left = self.total - self.done
        if left == 0:
            return f"run {self.done}/{self.total}, done"
        if not self.fresh:
            return f"run {self.done}/{self.total}, ETA unknown yet"
        return f"run {self.done}/{self.total}, ETA {duration((self.now() - self.t0) / self.fresh * left)}"


def eval_progress(total: int, batch_size: int, label: str = ""):
    """Where an evaluation of `total` problems is: a tqdm bar on a terminal (none for one batch); off a terminal,
    with a `label`, one line per update: "eval math500: 64/500 problems, 41 s, ETA 4 min 39 s" (a log file gets
    no carriage returns); without a label, nothing (the training loop's periodic evaluation)."""
    from tqdm.auto import tqdm

    if not bar_disabled() or not label:
        return tqdm(total=total, desc="eval", unit="problem", disable=total <= batch_size or bar_disabled())

    class Lines:
        def __init__(self):
            self.done, self.t0 = 0, time.time()

        def update(self, k: int) -> None:
            self.done += k
            spent = time.time() - self.t0
            left = "done" if self.done >= total else f"ETA {duration(spent / self.done * (total - self.done))}"
            print(f"eval {label}: {self.done}/{total} problems, {duration(spent)}, {left}", flush=True)

        def close(self) -> None:
            pass

    return Lines()


def pick_rollouts(n: int, seed: int, k: int = ROLLOUTS_PER_STEP) -> list[int]:
    """The indices of the k rollouts of a step kept whole, drawn from (seed, step) so a resume keeps the same."""
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n, size=min(k, n), replace=False).tolist())


def log_rollouts(run_dir: str, step: int, trajs: list, seed: int, k: int = ROLLOUTS_PER_STEP) -> None:
    """Append k of the step's rollouts (the policy's own samples, before any repair) to rollouts.jsonl."""
    with open(os.path.join(run_dir, "rollouts.jsonl"), "a", encoding="utf-8") as f:
        for i in pick_rollouts(len(trajs), seed, k):
            t = trajs[i]
            f.write(json.dumps({"step": step, "group": t.group, "question": t.question, "answer": t.answer,
                                "text": t.text, "reward": t.reward, "correct": t.correct, "finished": t.finished,
                                "tokens": len(t.response_ids)}) + "\n")


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return False


@contextlib.contextmanager
def summary_to_file(path: str, enabled: bool = True):
    """What is printed inside the block also goes to `path` (the closing summary as a file)."""
    if not enabled:
        yield
        return
    with open(path, "w", encoding="utf-8") as f:
        stdout = sys.stdout
        sys.stdout = _Tee(stdout, f)
        try:
            yield
        finally:
            sys.stdout = stdout


def closing_outputs(run_dir: str) -> dict:
    """What a finished run leaves beside its logs, each path printed on one line: curves.png (harness/run/curves.py's
    plot of metrics.jsonl) and model/ (harness/run/export.py). A failure of either is one warning line naming the
    command that retries it, never the run's end (its checkpoint is saved)."""
    written = {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        from harness.run.curves import plot_runs
        written["curves"] = plot_runs([run_dir], os.path.join(run_dir, "curves.png"))
    except Exception as err:   # the run is done; a missing picture must not turn it into a failure
        print(f"warning: no curves.png ({type(err).__name__}: {err}); python -m tools.report --plot {run_dir}",
              file=sys.stderr)
    try:
        from harness.run.export import export_run
        written["model"] = export_run(run_dir, quiet=True)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"warning: no model/ written ({err}); python -m harness.run.export {run_dir}", file=sys.stderr)
    print("written: " + ", ".join([*written.values(), os.path.join(run_dir, "summary.txt")])
          + (" (model: bf16 weights, tokenizer, model card; transformers and vllm serve load it)" if "model" in written
             else ""))
    return written
