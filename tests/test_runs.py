"""Runs that never lose work (runs.py, harness/run/wiring.py:open_run) and regression tests of the training path.

- unit tests of the checkpoint swap, its recovery, the lock and the JSONL reader, on fake models (no torch
  model is saved: save_pretrained writes one file), each kill window simulated by the state it leaves;
- subprocess tests of the CLI on one finished 2-step toy run (built once, copied per test): a second run
  under the same name is refused, a resume recovers from a kill mid-save and from a torn last log line,
  a folder without checkpoint is resumed only with --overwrite, a second process on a live run stops;
- kept_tokens and pad_token_id, the regression tests of the two training-path bugs.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import pace, run_scope
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.run import config, preflight, runs, wiring  # noqa: E402
import scope  # noqa: E402

TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "96",
        "--micro-batch-size", "4", "--eval-size", "4", "--save-every", "1", "--eval-every", "0"]


class FakeModel:
    def __init__(self, tag, file="model.txt"):
        self.tag, self.file = tag, file

    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, self.file), "w") as f:
            f.write(self.tag)


class FakeOptimizer:
    def state_dict(self):
        return {"state": {}}


def save(run_dir, step):
    runs.save_checkpoint(str(run_dir), step, FakeModel(f"step {step}"), FakeModel("tokenizer", "tokenizer.txt"), FakeOptimizer())


def model_tag(path):
    with open(os.path.join(path, "model.txt")) as f:
        return f.read()


# ------------------------------------------------------------------------------------------------ checkpoint swap
def test_save_swaps_without_leftovers(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]
    assert model_tag(tmp_path / "checkpoint") == "step 20" and runs.checkpoint_step(str(tmp_path / "checkpoint")) == 20


def test_kill_after_old_checkpoint_removed_recovers_the_tmp_one(tmp_path):
    """Regression: a kill after `rmtree(checkpoint)` and before `os.replace(tmp, checkpoint)` left no checkpoint/
    but a complete checkpoint.tmp/; `--resume` then restarted from step 1, truncated the logs and deleted
    checkpoint.tmp (20 steps lost). The state that kill leaves: only a complete checkpoint.tmp."""
    save(tmp_path, 20)
    os.replace(tmp_path / "checkpoint", tmp_path / "checkpoint.tmp")
    assert runs.find_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint.tmp"), 20)
    assert os.path.isdir(tmp_path / "checkpoint.tmp"), "find_checkpoint must only read"
    assert runs.recover_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint"), 20)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"] and model_tag(tmp_path / "checkpoint") == "step 20"


def test_every_kill_point_of_the_swap_leaves_the_newest_complete_checkpoint(tmp_path):
    """Each state a kill can leave during save_checkpoint(step 20) after a checkpoint of step 10."""
    save(tmp_path, 10)
    states = {}
    # (a) killed while writing checkpoint.tmp (state.pt not yet there): step 10 stays the one
    a = tmp_path / "a"
    shutil.copytree(tmp_path / "checkpoint", a / "checkpoint")
    FakeModel("half").save_pretrained(str(a / "checkpoint.tmp"))
    states["a"] = (a, 10, "step 10")
    # (b) tmp complete, checkpoint renamed to checkpoint.old, tmp not yet renamed in
    b = tmp_path / "b"
    shutil.copytree(tmp_path / "checkpoint", b / "checkpoint.old")
    save(b / "new", 20)
    os.replace(b / "new" / "checkpoint", b / "checkpoint.tmp")
    states["b"] = (b, 20, "step 20")
    # (c) new one in place, old not yet deleted
    c = tmp_path / "c"
    shutil.copytree(tmp_path / "checkpoint", c / "checkpoint.old")
    save(c, 20)
    states["c"] = (c, 20, "step 20")
    # (d) tmp complete, checkpoint not yet renamed aside
    d = tmp_path / "d"
    shutil.copytree(tmp_path / "checkpoint", d / "checkpoint")
    save(d / "new", 20)
    os.replace(d / "new" / "checkpoint", d / "checkpoint.tmp")
    states["d"] = (d, 20, "step 20")
    for name, (folder, step, tag) in states.items():
        assert runs.recover_checkpoint(str(folder)) == (str(folder / "checkpoint"), step), name
        assert model_tag(folder / "checkpoint") == tag, name
        assert not (folder / "checkpoint.tmp").exists() and not (folder / "checkpoint.old").exists(), name


def test_a_torn_state_file_is_not_a_checkpoint(tmp_path):
    save(tmp_path, 10)
    (tmp_path / "checkpoint" / "state.pt").write_bytes(b"\x80\x02torn")
    assert runs.checkpoint_step(str(tmp_path / "checkpoint")) is None and runs.find_checkpoint(str(tmp_path)) is None


# ------------------------------------------------------------------------------------------------ lock
def test_lock_is_exclusive_and_stale_locks_are_taken_over(tmp_path, capsys):
    """Regression: two runs with the same --run-name at once both ran and interleaved their JSONL lines."""
    path = runs.acquire_lock(str(tmp_path))
    with pytest.raises(SystemExit) as exc:    # this process is alive: a second taker stops at once
        runs.acquire_lock(str(tmp_path))
    assert exc.value.code == 2 and f"pid {os.getpid()}" in capsys.readouterr().err
    runs.release_lock(path)
    assert not os.path.exists(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(path, "w") as f:
        f.write(f"{dead.pid} {__import__('socket').gethostname()}")
    assert runs.lock_holder(str(tmp_path)) is None
    runs.acquire_lock(str(tmp_path))
    assert "stale lock" in capsys.readouterr().err
    with open(path) as f:
        assert f.read().split()[0] == str(os.getpid())


def test_config_json_records_the_environment_and_a_resume_ignores_it(tmp_path, monkeypatch):
    """config.json holds the flags and, under "environment", the versions and commit the run started with; a
    resume reads the flags and leaves the record alone (a new machine is not a changed flag)."""
    monkeypatch.setattr(wiring, "environment", lambda: {"torch": "9.9", "commit": "abc", "dirty": False})
    args = scope.parse_args(["--toy", "--run-name", "r", "--steps", "4"])
    run = tmp_path / "r"
    run.mkdir()
    wiring.open_run(args, str(run), None)
    runs.release_lock(str(run / "lock"))
    config = json.loads((run / "config.json").read_text())
    assert config["environment"] == {"torch": "9.9", "commit": "abc", "dirty": False} and config["steps"] == 4
    resumed = scope.parse_args(["--resume", str(run)])
    assert resumed.steps == 4 and preflight.resume_changes(resumed, str(run)) == {}
    here = runs.environment()
    assert here["torch"] == torch.__version__ and {"python", "numpy", "scipy", "cpu", "commit", "dirty"} <= set(here)


# ------------------------------------------------------------------------------------------------ logs
def test_torn_last_jsonl_line_is_dropped_with_a_warning(tmp_path, capsys):
    """Regression: a torn last line (a kill mid-write) made `--resume` die with JSONDecodeError in truncate_jsonl."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.1 * s}) + "\n" for s in range(1, 5)) + '{"step": 5, "lo')
    runs.truncate_jsonl(str(path), 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert "torn last line" in capsys.readouterr().err
    path.write_text('{"step": 1}\n{"step": 2, "garb\n{"step": 3}\n')   # interleaved writers: not a torn tail
    with pytest.raises(SystemExit) as exc:
        runs.truncate_jsonl(str(path), 3)
    assert exc.value.code == 2 and "line 2" in capsys.readouterr().err
    assert path.read_text().count("\n") == 3, "a refused truncation must not rewrite the file"


# ------------------------------------------------------------------------------------------------ CLI, on a real toy run
def read_steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, toy_model_dir):
    """A finished 2-step toy run (checkpoint every step) of a tiny warm start: (cwd, command flags)."""
    cwd = tmp_path_factory.mktemp("work")
    flags = ["--toy", "--model", toy_model_dir, "--run-name", "r", *TINY]
    run_scope(flags, cwd)
    return cwd, flags


@pytest.fixture
def run_copy(finished_run, tmp_path):
    cwd, flags = finished_run
    shutil.copytree(cwd / "runs", tmp_path / "runs")
    return tmp_path, flags


@pytest.mark.slow
def test_second_run_under_the_same_name_is_refused(run_copy):
    """Regression: `python scope.py --toy --toy-prm-noise 0.2` after `python scope.py --toy` reopened
    runs/scope-toy-s0 with "w": metrics, traces and checkpoint replaced without a word."""
    cwd, flags = run_copy
    before = (cwd / "runs" / "r" / "metrics.jsonl").read_text()
    t0 = time.time()
    proc = run_scope([*flags, "--toy-prm-noise", "0.2"], cwd, check=False)
    assert proc.returncode == 2 and time.time() - t0 < 30 * pace()
    assert "already holds a run" in proc.stderr and "--overwrite" in proc.stderr and "--resume" in proc.stderr
    assert (cwd / "runs" / "r" / "metrics.jsonl").read_text() == before
    run_scope([*flags, "--toy-prm-noise", "0.2", "--steps", "1", "--overwrite"], cwd)   # on purpose: replaced
    assert read_steps(cwd / "runs" / "r" / "metrics.jsonl") == [1]
    assert json.loads((cwd / "runs" / "r" / "config.json").read_text())["toy_prm_noise"] == 0.2
    assert not (cwd / "runs" / "r" / "lock").exists(), "the lock is released at exit"


@pytest.mark.slow
def test_resume_after_a_kill_mid_save_and_a_torn_log_line(run_copy):
    """Regression: the checkpoint kill window (only checkpoint.tmp left) and a torn last JSONL line both lost work
    or crashed the resume; now the resume continues from step 2 and keeps steps 1-2 of the logs."""
    cwd, _ = run_copy
    run = cwd / "runs" / "r"
    os.replace(run / "checkpoint", run / "checkpoint.tmp")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "mode": "sco')
    with open(run / "traces.jsonl", "a") as f:
        f.write('{"step": 3, "gro')
    proc = run_scope(["--resume", "runs/r", "--steps", "3"], cwd)
    assert "recovered the checkpoint of step 2" in proc.stderr and "torn last line" in proc.stderr
    assert "resumed runs/r at step 3" in proc.stdout
    assert read_steps(run / "metrics.jsonl") == [1, 2, 3]
    assert all(s <= 3 for s in read_steps(run / "traces.jsonl"))
    assert sorted(p for p in os.listdir(run) if p.startswith("checkpoint")) == ["checkpoint"]
    assert runs.checkpoint_step(str(run / "checkpoint")) == 3


@pytest.mark.slow
def test_resume_below_the_checkpoint_step_is_refused(run_copy):
    """Regression: `--resume RUN --steps 5` on a run at step 30 said "done" and rewrote config.json to steps 5."""
    cwd, _ = run_copy
    config = (cwd / "runs" / "r" / "config.json").read_text()
    proc = run_scope(["--resume", "runs/r", "--steps", "1"], cwd, check=False)
    assert proc.returncode == 2 and "--steps 1" in proc.stderr and "(2)" in proc.stderr
    assert (cwd / "runs" / "r" / "config.json").read_text() == config


@pytest.mark.slow
def test_folder_without_checkpoint_is_resumed_only_on_purpose(run_copy):
    """Regression: a run folder with a config but no checkpoint (a crash before the first save) was silently
    restarted from step 1, wiping its logs."""
    cwd, _ = run_copy
    run = cwd / "runs" / "r"
    shutil.rmtree(run / "checkpoint")
    logs = (run / "metrics.jsonl").read_text()
    proc = run_scope(["--resume", "runs/r"], cwd, check=False)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr and "--overwrite" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == logs
    run_scope(["--resume", "runs/r", "--steps", "1", "--overwrite"], cwd)
    assert read_steps(run / "metrics.jsonl") == [1]


@pytest.mark.slow
def test_second_process_on_a_live_run_stops_at_once(run_copy):
    """Regression: two runs on one folder at once interleaved their logs and overwrote each other's checkpoint."""
    cwd, _ = run_copy
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(cwd / "runs" / "r" / "lock", "w") as f:
            f.write(f"{holder.pid} {__import__('socket').gethostname()}")
        proc = run_scope(["--resume", "runs/r", "--steps", "3"], cwd, check=False)
        assert proc.returncode == 2 and f"in use by another run (pid {holder.pid}" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    run_scope(["--resume", "runs/r", "--steps", "3"], cwd)   # the holder is gone: its lock is stale, taken over
    assert read_steps(cwd / "runs" / "r" / "metrics.jsonl") == [1, 2, 3]


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_resume_with_a_changed_training_flag_is_refused_or_recorded(run_copy):
    """`--resume RUN --lr 0.1` overwrote config.json with "lr": 0.1 without a word: the record of how the run
    was trained was gone. Now: one line, exit 2, config.json unchanged; with --change-config the change is
    recorded with its step in changes.jsonl (config.json still unchanged) and later resumes keep it."""
    cwd, _ = run_copy
    run = cwd / "runs" / "r"
    config, logs = md5(run / "config.json"), (run / "metrics.jsonl").read_text()
    proc = run_scope(["--resume", "runs/r", "--steps", "3", "--lr", "0.1"], cwd, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "--lr 0.1 (the run has 0.0001)" in errors[0] and "--change-config" in errors[0]
    assert md5(run / "config.json") == config and (run / "metrics.jsonl").read_text() == logs
    assert not (run / "changes.jsonl").exists()
    proc = run_scope(["--resume", "runs/r", "--steps", "3", "--lr", "0.1", "--change-config"], cwd)
    assert md5(run / "config.json") == config and read_steps(run / "metrics.jsonl") == [1, 2, 3]
    assert runs.read_changes(str(run)) == [{"step": 3, "changes": {"steps": [2, 3], "lr": [0.0001, 0.1]}}]
    assert "config changed from step 3: --steps 2 -> 3, --lr 0.0001 -> 0.1" in proc.stdout
    proc = run_scope(["--resume", "runs/r", "--steps", "4", "--dry-run"], cwd)   # the settings now: lr 0.1 kept
    assert '"lr": 0.1,' in proc.stdout and '"steps": 4,' in proc.stdout
    assert len(runs.read_changes(str(run))) == 1, "a dry run records nothing"


@pytest.mark.slow
def test_resuming_a_finished_run_is_one_line(run_copy):
    """`--resume` of a finished run said `resumed ... at step 3`, then `before n/a -> after n/a`."""
    cwd, _ = run_copy
    run = cwd / "runs" / "r"
    config, logs = md5(run / "config.json"), (run / "metrics.jsonl").read_text()
    proc = run_scope(["--resume", "runs/r"], cwd)
    assert proc.stdout.strip().splitlines() == [
        "runs/r is finished (step 2 of --steps 2): nothing to do; --resume runs/r --steps N (N > 2) trains it further"]
    assert md5(run / "config.json") == config and (run / "metrics.jsonl").read_text() == logs
    assert not (run / "lock").exists() and not (run / "changes.jsonl").exists()


@pytest.mark.slow
def test_the_data_is_checked_before_the_run_folder(run_copy):
    """A missing --dataset file was reported only after the run folder's name clash."""
    cwd, flags = run_copy
    proc = run_scope([*flags, "--dataset", "no_such.jsonl"], cwd, check=False)
    assert proc.returncode == 2 and "--dataset no_such.jsonl" in proc.stderr and "already holds" not in proc.stderr


# scope.py run with a stdout that, once it has written a line starting with PAUSE_AT, holds the run there (in
# that write, inside the training loop) until a signal ends it: the signal can never arrive after the run has
# gone on to save or finish, however slow the test is to read the line
PAUSING = """
import os, runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # as at a terminal, even if the tests' launcher ignored it
target, pause_at = sys.argv[1], os.environ["PAUSE_AT"]


class Pausing:
    def __init__(self, stream):
        self.stream, self.line = stream, ""

    def write(self, text):
        n = self.stream.write(text)
        self.stream.flush()
        self.line += text
        while "\\n" in self.line:
            line, self.line = self.line.split("\\n", 1)
            if line.startswith(pause_at):
                while True:
                    time.sleep(1)
        return n

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout = Pausing(sys.stdout)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
runpy.run_path(target, run_name="__main__")
"""


def scope_until(args, cwd, line_start, sig):
    """Start scope.py, send `sig` once a stdout line starts with `line_start` (the run held at that line until
    the signal arrives, `PAUSING`); (returncode, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PAUSE_AT": line_start}
    proc = subprocess.Popen([sys.executable, "-c", PAUSING, os.path.join(ROOT, "scope.py"), *args], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith(line_start):
                proc.send_signal(sig)   # mid-run: held at this line of the step loop
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, "".join(out) + stdout, stderr


def comparable(path):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in map(json.loads, open(path))]


@pytest.mark.slow
def test_interrupt_says_how_to_resume_and_the_resume_is_exact(toy_model_dir, tmp_path):
    """Ctrl-C printed a 76-line KeyboardInterrupt traceback and no line saying where the last checkpoint was.
    Now SIGINT and SIGTERM end the run with one line naming the checkpoint's step and the --resume command, the
    lock released; the run resumed twice matches an uninterrupted one (metrics and the closing summary, which
    reads the whole run's logs: the step-0 evaluation, the first steps' reward). Every random draw derives from
    (seed, step), the noisy toy PRM's flips included, and the optimizer state is restored: a resume that redrew
    prompts, samples or flips differently, or lost AdamW's moments, would change a later step's metrics."""
    flags = ["--toy", "--model", toy_model_dir, *TINY, "--steps", "5", "--eval-every", "2", "--toy-prm-noise", "0.2"]
    full = run_scope([*flags, "--run-name", "full"], tmp_path)
    run = tmp_path / "runs" / "r"
    for command, line_start, sig in ((["--run-name", "r", *flags], "step 2/5,", signal.SIGINT),
                                     (["--resume", "runs/r"], "step 3/5,", signal.SIGTERM)):
        code, stdout, stderr = scope_until(command, tmp_path, line_start, sig)
        assert code == 130, (code, stdout, stderr)
        step = runs.find_checkpoint(str(run))[1]
        said = [line for line in stderr.splitlines() if line.startswith("interrupted")]
        assert said == [f"interrupted: the last complete checkpoint is step {step} ({run.relative_to(tmp_path)}/"
                        f"{os.path.basename(runs.find_checkpoint(str(run))[0])}); continue with: "
                        f"python scope.py --resume runs/r"], stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
        assert not (run / "lock").exists()
    resumed = run_scope(["--resume", "runs/r"], tmp_path)
    assert comparable(run / "metrics.jsonl") == comparable(tmp_path / "runs" / "full" / "metrics.jsonl")

    def summary(text):   # the closing lines but the time
        lines = text[text.index("\ndone in"):].strip().splitlines()
        return [lines[0].split(". ", 1)[1]] + [line for line in lines[1:]
                                                if not line.startswith(("logs:", "plot:", "written:"))]
    assert summary(resumed.stdout) == summary(full.stdout)
    assert "before n/a" not in resumed.stdout and "resumed at step" in resumed.stdout


# ------------------------------------------------------------------------------------------------ training path
def test_empty_failed_response_keeps_nothing():
    """Regression: an empty failed response (split_steps → no steps, cut 0) got prefix_len = len(response_ids): a
    bare EOS was kept as the "prefix", trained on-policy with positive advantage, the refiner's tokens followed
    an EOS, and keep_ratio_tokens logged 1.0."""
    import prm
    from refine import Trajectory

    class PRM:
        def score_batch(self, questions, steps):
            return [[0.9] * len(s) for s in steps]

    class Tok:
        def decode(self, ids, **kw):
            return "".join(chr(i) for i in ids)

    eos = 3
    trajs = [Trajectory(question="q", answer="1", group=0, prompt_ids=[1], response_ids=[eos], text="")]
    trajs[0].correct = False
    prm.locate_first_errors(trajs, PRM(), Tok(), tau=0.5)
    assert trajs[0].prefix_len == 0 and trajs[0].keep_ratio_tokens == 0.0
    assert prm.kept_tokens([], 0, 1) == 0
    assert prm.kept_tokens([(0, 4), (4, 9)], 1, 12) == 4 and prm.kept_tokens([(0, 4)], 1, 12) == 12


def test_pad_id_falls_back_to_eos():
    """Regression: scope.py passed tokenizer.pad_token_id to build_batch unguarded; a tokenizer without a pad token
    (Llama/Mistral style) crashed the update (`full(): ... must be Number, not NoneType`)."""
    from types import SimpleNamespace

    from grpo import build_batch

    tok = SimpleNamespace(pad_token_id=None, eos_token_id=2)
    assert wiring.pad_or_eos(tok) == 2
    assert wiring.pad_or_eos(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == 0
    batch = build_batch([[5], [7]], [[8], [9, 10]], [None, None], torch.tensor([1.0, -1.0]), wiring.pad_or_eos(tok))
    assert batch["input_ids"][1, -1].item() == 10 and batch["input_ids"][0, -1].item() == 2
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        wiring.pad_or_eos(SimpleNamespace(pad_token_id=None, eos_token_id=None))


# ------------------------------------------------------------------------------------- refusals that cost no run
def refused(capsys, flags) -> str:
    """scope.main's one-line refusal (exit 2) of `flags` typed on the command line (as_args: the same flags typed)."""
    with pytest.raises(SystemExit) as exit_:
        scope.main(config.as_args(scope.Args, flags))
    err = capsys.readouterr().err.strip() or str(exit_.value.code)
    assert "\n" not in err, err
    return err


def test_a_toy_model_that_is_no_folder_stops_at_once_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """`--toy --model nosuch-model` spent 50 s on hub retries, then left runs/…/config.json, which refused the
    corrected command; a typo of a local folder was told to `hf download` it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "model").mkdir()
    start = time.time()
    err = refused(capsys, {"toy": True, "model": "nosuch-model"})
    assert err.startswith("error: --model nosuch-model with --toy: no such folder; --toy trains 'toy'")
    assert time.time() - start < 20 and os.listdir(tmp_path / "runs") == ["old"]
    err = refused(capsys, {"toy": True, "model": "runs/old/modle"})
    assert "no such folder (did you mean runs/old/model?)" in err and "hf download" not in err
    err = refused(capsys, {"model": "runs/old/modle", "dry_run": True})
    assert "'runs/old/modle': no such folder (did you mean runs/old/model?)" in err


def test_a_model_that_fails_to_load_takes_its_new_run_folder_with_it(tmp_path, monkeypatch, capsys):
    """The run folder was written before the model loaded, so a failed load left a folder that refused the
    corrected command ("already holds a run")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_:
        scope.main({"toy": True, "model": "broken", "run_name": "r"})
    err = capsys.readouterr().err
    assert "cannot load 'broken'" in str(exit_.value.code) + err and "hf download" not in str(exit_.value.code) + err
    assert not (tmp_path / "runs" / "r").exists()


def test_an_unwritable_run_folder_is_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    """An unwritable output folder gave a 16-line traceback from os.makedirs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where the runs folder goes")
    assert refused(capsys, {"toy": True}) == (f"error: runs/scope-toy-s0: cannot write there ({tmp_path / 'runs'} is "
                                              f"not a folder); run from a folder you can write, or pass --run-name")
    os.remove(tmp_path / "runs")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path) and real_access(path, mode))
    assert f"({tmp_path} is not writable by this user)" in refused(capsys, {"toy": True})


def test_flags_the_mode_ignores_are_named(capsys):
    """`--merge append --mode grpo` ran without a word that --merge does nothing there."""
    preflight.check_args(scope.parse_args(["--toy", "--mode", "grpo", "--merge", "append", "--shaping-gamma", "0.2"]))
    assert capsys.readouterr().err == "note: --mode grpo ignores --merge append, --shaping-gamma 0.2\n"
    preflight.check_args(scope.parse_args(["--toy", "--mode", "grpo"]))
    preflight.check_args(scope.parse_args(["--toy", "--merge", "append"]))
    assert capsys.readouterr().err == ""
    preflight.check_args(scope.parse_args(["--toy", "--prm-reward-coef", "0.3"]))
    assert capsys.readouterr().err == "note: --mode scope ignores --prm-reward-coef 0.3\n"


def test_a_step_without_reward_signal_is_told():
    """A CPU run whose every group failed showed gradient norm 0.000 and nothing said that nothing was learned."""
    from types import SimpleNamespace as T

    assert wiring.no_reward_signal([T(group=0, reward=0.0), T(group=0, reward=0.0), T(group=1, reward=1.0),
                                    T(group=1, reward=1.0)])
    assert not wiring.no_reward_signal([T(group=0, reward=0.0), T(group=0, reward=1.0), T(group=1, reward=0.0)])


def test_the_eta_leaves_out_the_evaluation_before_training(monkeypatch):
    """The first ETAs were 2-3x too high: step 1's time included the evaluation before training."""
    from types import SimpleNamespace as T

    now = [100.0]
    clock = wiring.progress.StepClock
    monkeypatch.setattr(wiring.progress, "StepClock", lambda start, total: clock(start, total, now=lambda: now[0]))
    monkeypatch.setattr(wiring.Run, "eval_before_training", lambda self: now.__setitem__(0, now[0] + 60.0))
    models = dict.fromkeys(["policy", "tokenizer", "ref_model", "generator", "prm", "refiner", "optimizer"])
    run = wiring.Run(T(steps=11, prompts_per_step=2, eval_every=5, seed=0, warmup_steps=0), "r", "cpu", False, **models,
                     train_problems=[{"q": 1}, {"q": 2}], eval_problems=[], start_step=1, metrics_file=None,
                     traces_file=None, t_start=0.0)
    next(run.steps())    # the evaluation before training (60 s), then step 1 starts
    now[0] += 2.0        # step 1 takes 2 s
    assert run.clock.eta(1) == pytest.approx(2.0 * 10)


def test_the_dry_run_and_the_config_show_the_run_name_they_use(tmp_path, monkeypatch, capsys):
    """The dry run said it "would write runs/scope-Qwen2.5-1.5B-s0" but showed "run_name": "" (as did the card)."""
    monkeypatch.chdir(tmp_path)
    plan = scope.main({"toy": True, "dry_run": True})   # from Python a dry run returns its plan, stdout quiet
    out = plan["text"]
    assert capsys.readouterr().out == ""
    assert "would write runs/scope-toy-s0" in out and '"run_name": "scope-toy-s0"' in out
    assert plan["run_dir"] == "runs/scope-toy-s0" and plan["args"]["run_name"] == "scope-toy-s0"


def test_ctrl_c_in_a_notebook_releases_the_lock_and_the_next_call_resumes(toy_model_dir, tmp_path, monkeypatch,
                                                                         capsys):
    """scope.main called from Python (a notebook cell) and interrupted kept runs/NAME/lock held by the kernel's own
    pid, so the next cell's resume was refused as "in use by another run", and no "interrupted:" line was printed.
    Now the call prints the line with the main(...) call that resumes, releases the lock and raises the
    KeyboardInterrupt on (the cell shows it interrupted); the next call resumes from the checkpoint."""
    monkeypatch.chdir(tmp_path)
    real_end_step = wiring.Run.end_step

    def ctrl_c_after_step_1(self, step, *a, **k):
        real_end_step(self, step, *a, **k)
        if step == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(wiring.Run, "end_step", ctrl_c_after_step_1)
    call = {"toy": True, "model": toy_model_dir, "run_name": "nb", "steps": 2, "prompts_per_step": 2,
            "group_size": 2, "max_new_tokens": 96, "micro_batch_size": 4, "eval_size": 4, "save_every": 1,
            "eval_every": 0}   # TINY
    with pytest.raises(KeyboardInterrupt):
        scope.main(call)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("interrupted")]
    assert said == ['interrupted: the last complete checkpoint is step 1 (runs/nb/checkpoint); continue with: '
                    'main({"resume": "runs/nb"})']
    assert not (tmp_path / "runs" / "nb" / "lock").exists()
    monkeypatch.setattr(wiring.Run, "end_step", real_end_step)
    scope.main({"resume": "runs/nb"})   # the same process: no "in use by another run"
    assert read_steps(tmp_path / "runs" / "nb" / "metrics.jsonl") == [1, 2]
    assert not (tmp_path / "runs" / "nb" / "lock").exists()   # a finished call leaves the run unlocked too


def test_resume_of_a_checkpoint_folder_names_the_run_folder(tmp_path, monkeypatch, capsys):
    """`--resume runs/NAME/checkpoint` (TRL's resume_from_checkpoint habit) said "config.json has keys scope.py does
    not know ... another program or version?" (a LoRA checkpoint: "not a scope.py run folder"): both say to pass
    the run folder."""
    from dataclasses import asdict

    monkeypatch.chdir(tmp_path)
    for kind, files in (("full", {"config.json": '{"model_type": "qwen2"}'}),
                        ("lora", {"adapter_config.json": '{"peft_type": "LORA"}'})):
        ckpt = tmp_path / "runs" / kind / "checkpoint"
        ckpt.mkdir(parents=True)
        (ckpt.parent / "config.json").write_text(json.dumps({**asdict(scope.Args(toy=True)), "environment": {}}))
        for name, text in files.items():
            (ckpt / name).write_text(text)
        for typed in (f"runs/{kind}/checkpoint", f"runs/{kind}/checkpoint/"):
            with pytest.raises(SystemExit) as exit_:
                scope.parse_args(["--resume", typed])
            assert exit_.value.code == 2 and capsys.readouterr().err == (
                f"error: --resume {typed}: the checkpoint/ folder of run runs/{kind}; --resume takes the run folder "
                f"(it continues from that run's newest complete checkpoint): --resume runs/{kind}\n")


def test_a_run_name_is_a_name_under_runs(tmp_path, monkeypatch, capsys):
    """`--run-name ../x` wrote the run outside runs/, where --resume runs/NAME, tools.report and eval.py's reports do
    not look: a name that climbs out with '..' is one line, and nothing is written; an absolute path is the run
    folder itself (the studies keep their runs so) and a relative one with a '/' nests under runs/."""
    monkeypatch.chdir(tmp_path / "..")
    here = os.getcwd()
    monkeypatch.chdir(tmp_path)
    for name in ("../x", "a/../../x", ".."):
        assert refused(capsys, {"toy": True, "run_name": name}) == (
            f"error: --run-name {name}: a run name stays under runs/ ('..' would leave it); to keep a run elsewhere "
            f"give its folder as an absolute path")
    assert os.listdir(tmp_path) == [] and not os.path.exists(os.path.join(here, "x"))
    with pytest.raises(runs.Refused, match=r"^run_name=\.\./x: a run name stays under runs/"):
        scope.main({"toy": True, "run_name": "../x"})
    assert scope.main({"toy": True, "run_name": "a/b", "dry_run": True})["run_dir"] == os.path.join("runs", "a", "b")
    absolute = str(tmp_path / "elsewhere")
    assert scope.main({"toy": True, "run_name": absolute, "dry_run": True})["run_dir"] == absolute


def test_a_lora_checkpoint_as_a_model_to_train_names_the_merged_model(tmp_path, monkeypatch, capsys):
    """`--model runs/R/checkpoint` of a LoRA run said "no config.json in that folder": it is an adapter, and the
    line names the run's merged model/ and the resume; with --toy a run folder or an adapter got a tokenizer error
    after the load was tried: both are now the same one line, before anything loads."""
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "runs" / "r" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt.parent / "config.json").write_text('{"lora_rank": 16, "environment": {}}')
    (ckpt / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    adapter_line = ("error: --model runs/r/checkpoint: a LoRA adapter (no config.json), not a model; pass runs/r/model "
                    "(the merged model; python -m harness.run.export runs/r writes it), or --resume runs/r to train on")
    assert refused(capsys, {"model": "runs/r/checkpoint", "dry_run": True}) == adapter_line
    assert refused(capsys, {"toy": True, "model": "runs/r/checkpoint"}) == adapter_line   # --toy: before any load
    (ckpt.parent / "model").mkdir()
    (ckpt.parent / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    assert refused(capsys, {"toy": True, "model": "runs/r"}) == (   # the adapter is no model to start from
        "error: --model runs/r: a run folder, not a model; pass runs/r/model (the model it wrote when it finished)")
    assert os.listdir(tmp_path / "runs") == ["r"]
