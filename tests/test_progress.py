"""harness/run/progress.py: step k/N and ETA off a terminal, a study's k/N, rollouts.jsonl, the closing files."""
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

from harness.run import progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_step_line_position_and_eta_by_hand():
    now = Clock()
    clock = progress.StepClock(start_step=11, total=30, now=now)   # a resume: this process runs 11..30
    now.t += 20.0                                                   # steps 11 and 12 took 20 s together
    line = "step   12 | reward 0.500, after repairs 0.600"
    assert clock.line(line, 12) == "step 12/30, ETA 3 min 00 s | reward 0.500, after repairs 0.600"   # 10 s × 18
    assert clock.line("step   30 | reward 1.000", 30) == "step 30/30, done | reward 1.000"


def test_duration():
    assert [progress.duration(s) for s in (0, 59.4, 65, 3599, 7620)] == ["0 s", "59 s", "1 min 05 s",
                                                                           "59 min 59 s", "2 h 07 min"]


def test_bars_only_on_a_terminal():
    assert progress.bar_disabled(io.StringIO())   # a log file
    assert not progress.bar_disabled(SimpleNamespace(isatty=lambda: True))


def test_study_clock_counts_cached_runs_as_done_but_not_into_the_rate():
    now = Clock()
    study = progress.StudyClock(total=5, now=now)
    assert study.finished(0.2) == "run 1/5, ETA unknown yet"   # finished in an earlier invocation
    now.t += 600.0
    assert study.finished(600.0) == "run 2/5, ETA 30 min 00 s"  # 600 s per fresh run × 3 left
    now.t += 600.0
    assert study.finished(590.0) == "run 3/5, ETA 20 min 00 s"
    study.finished(600.0)
    assert study.finished(600.0) == "run 5/5, done"


def test_rollouts_are_drawn_from_the_seed_and_written_whole(tmp_path):
    trajs = [SimpleNamespace(group=i // 4, question=f"q{i // 4}", answer="1", text=f"text {i}", reward=float(i % 2),
                             correct=bool(i % 2), finished=True, response_ids=[0] * i) for i in range(16)]
    progress.log_rollouts(str(tmp_path), 3, trajs, seed=7)
    progress.log_rollouts(str(tmp_path), 4, trajs, seed=8)
    rows = [json.loads(line) for line in open(tmp_path / "rollouts.jsonl")]
    assert [r["step"] for r in rows] == [3, 3, 4, 4]
    first = progress.pick_rollouts(16, 7)
    assert first == progress.pick_rollouts(16, 7) and len(set(first)) == 2   # the same on a resume
    assert [r["text"] for r in rows[:2]] == [f"text {i}" for i in first]
    assert rows[0]["tokens"] == first[0] and rows[0]["question"] == f"q{first[0] // 4}"


def test_summary_goes_to_the_screen_and_the_file(tmp_path, capsys):
    with progress.summary_to_file(str(tmp_path / "summary.txt")):
        print("done in 0.2 min.")
    assert capsys.readouterr().out == "done in 0.2 min.\n"
    assert (tmp_path / "summary.txt").read_text() == "done in 0.2 min.\n"


def test_the_eval_bar_writes_no_carriage_return_into_a_log_file(tmp_path):
    """eval.evaluate over more problems than one batch, stderr a file: no tqdm bar (it drew one before)."""
    code = ("import eval\nfrom types import SimpleNamespace as N\n"
            "class G:\n    def generate(self, prompts, **kw):\n"
            "        return [[N(text='\\\\boxed{1}', ids=[1], finished=True)] for _ in prompts]\n"
            "class T:\n    chat_template = None\n    def encode(self, text, add_special_tokens=False):\n"
            "        return [1]\n"
            "r = eval.evaluate(G(), T(), [{'id': i, 'question': 'q', 'answer': '1'} for i in range(10)], batch_size=2)\n"
            "print(r['acc'])\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=120)
    text = log.read_text()
    assert rc.returncode == 0, text
    assert "\r" not in text and text.strip().endswith("1.0")


def test_a_step_line_fits_160_characters_and_the_detail_is_behind_a_flag():
    """Step lines were 310-366 characters, 4-5 rows each on an 80-column terminal. The line a step prints fits 160
    with its position and ETA (a 500-step run's, an evaluation, 1,024-token answers, a 2-minute step); the phases'
    seconds, the loss, the keep ratio and the checkpoint come with --log-detail (off by default)."""
    import scope

    m = {"step": 123, "reward_mean": 0.453, "reward_merged": 0.531, "frac_all_fail": 0.125, "frac_all_pass": 0.25,
         "rectify_accepted": 12, "rectify_tried": 16, "rectify_all_fail": 3, "keep_ratio_steps": 0.48,
         "response_len": 1024.0, "entropy": 0.412, "loss": 0.0123, "grad_norm": 12.321, "skipped": 0,
         "time_step": 123.4, "time_rollout": 60.0, "time_prm": 20.0, "time_refine": 20.0, "time_update": 20.0,
         "time_eval": 3.0, "eval_acc": 0.3}
    clock = progress.StepClock(1, 500, now=iter([0.0, 12 * 3600 * 123 / 377]).__next__)   # 12 h left
    line = clock.line(progress.step_line(m, checkpoint_seconds=12.3), 123)
    assert line == ("step 123/500, ETA 12 h 00 min | reward 0.453 → 0.531, repaired 12/16 | all-fail 0.12, all-pass "
                    "0.25 | length 1024, entropy 0.41, grad 12.32 | 123 s | eval 0.300")
    assert len(line) <= 160
    toy = {**m, "step": 3, "response_len": 85.2, "grad_norm": 0.321, "time_step": 0.5}
    assert progress.step_line(toy).endswith("| 0.5 s | eval 0.300")
    detail = progress.step_line(m, checkpoint_seconds=12.3, detail=True)
    assert len(detail) > 250 and "keeping 48% of their steps" in detail and "then checkpoint 12.3 s" in detail
    assert "loss" not in line and "rollout" not in line and "checkpoint" not in line
    assert progress.step_line({**m, "skipped": 1}).count("grad 12.32 SKIPPED") == 1
    assert scope.Args().log_detail is False and scope.parse_args(["--log-detail"]).log_detail
