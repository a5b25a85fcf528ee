"""`scope.py --report-to` (harness/run/trackers.py): TensorBoard's event files hold the numbers of metrics.jsonl (read
back with TensorBoard's own reader), W&B logs offline without network, and a chosen tracker that is not installed
stops the run in one line before anything loads. TensorBoard and W&B are test-only installs (.ci/run)."""
import json
import os
import sys

import pytest

from conftest import run_scope

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.run import trackers  # noqa: E402
import scope  # noqa: E402

TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "96",
        "--micro-batch-size", "4", "--eval-size", "4", "--save-every", "1", "--eval-every", "1"]


def test_scalars_keep_the_numbers_and_drop_the_rest():
    record = {"step": 3, "mode": "scope", "reward_mean": 0.25, "rectify_tried": 2, "skipped": False,
              "near_miss_frac": None, "eval_acc": 0.5}
    assert trackers.scalars(record) == {"reward_mean": 0.25, "rectify_tried": 2.0, "skipped": 0.0, "eval_acc": 0.5}


def test_tensorboard_says_where_it_logs_and_how_to_view_it(tmp_path, capsys):
    """A newcomer could not find the event files: the run prints the logdir and the command that shows it."""
    pytest.importorskip("tensorboard")
    board = trackers.TensorBoard(str(tmp_path), {"lr": 1e-4}, first_step=1)
    board.writer.close()
    line = f"tensorboard: logging to {tmp_path}/tensorboard (view: tensorboard --logdir {tmp_path}/tensorboard)"
    assert line in capsys.readouterr().out.splitlines()
    assert os.listdir(tmp_path / "tensorboard")   # the event file is there


@pytest.mark.slow
def test_tensorboard_event_files_equal_metrics_jsonl(toy_model_dir, tmp_path):
    """Every number of every metrics.jsonl record (the step-0 evaluation included) is a TensorBoard scalar of
    the same name at the same step; the run's settings are there as text; a resume drops the events logged
    after its checkpoint instead of doubling them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--toy", "--model", toy_model_dir, "--run-name", "tb", *TINY, "--report-to", "tensorboard"]
    run_scope(flags, tmp_path)
    run = tmp_path / "runs" / "tb"
    from torch.utils.tensorboard import SummaryWriter   # as if a process had logged step 3 and died before its save
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "mode": "scope", "reward_mean": 9.0}) + "\n")
    dead = SummaryWriter(str(run / "tensorboard"))
    dead.add_scalar("reward_mean", 9.0, 3)
    dead.close()
    run_scope(["--resume", "runs/tb", "--steps", "3"], tmp_path)
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    expected = {}
    for r in records:
        for name, value in trackers.scalars(r).items():
            expected.setdefault(name, []).append((r["step"], value))
    assert {"reward_mean", "eval_acc", "loss", "rectify_accepted"} <= set(expected)
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in logged] == [s for s, _ in points], name
        assert [v for _, v in logged] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-7), name
    assert [s for s, _ in expected["eval_acc"]] == [0, 1, 2, 3] and 9.0 not in [v for _, v in expected["reward_mean"]]
    assert "config/text_summary" in events.Tags()["tensors"]


@pytest.mark.slow
def test_wandb_logs_offline_without_network(toy_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")   # as when api.wandb.ai cannot be reached (trackers.reachable)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_scope(["--toy", "--model", toy_model_dir, "--run-name", "wb", *TINY, "--report-to", "wandb"], tmp_path)
    offline = [d for d in os.listdir(tmp_path / "runs" / "wb" / "wandb") if d.startswith("offline-run-")]
    assert len(offline) == 1
    files = os.listdir(tmp_path / "runs" / "wb" / "wandb" / offline[0])
    assert any(name.endswith(".wandb") for name in files), files


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_one_line(kind, tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == kind else find_spec(name, *a))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        scope.main(scope.parse_args(["--toy", "--report-to", kind]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    version = {"tensorboard": "2.20.0", "wandb": "0.31.0"}[kind]   # pinned as the README's test line pins it
    assert err == f"error: --report-to {kind}: the {kind} package is not installed (pip install {kind}=={version})"
    assert not (tmp_path / "runs").exists()
