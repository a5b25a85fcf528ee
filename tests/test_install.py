"""pyproject.toml: `pip install -e .` installs the five method files as modules and harness/, tools/ as packages, with
requirements.txt's dependencies (one list); the code then finds the shipped toy warm starts from any folder and makes
runs/ in the current one."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIVE = ["scope", "prm", "refine", "grpo", "eval"]


def test_pyproject_installs_the_five_files_harness_and_tools_with_requirements_txts_dependencies():
    """`import scope` worked only from the repository root: there was no pyproject.toml, so no `pip install -e .`.
    (Installed by hand into a fresh venv and run from /tmp: see docs/running.md's Install; here the file is read as
    setuptools reads it.)"""
    import fnmatch
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert config["build-system"]["build-backend"] == "setuptools.build_meta"
    setuptools = config["tool"]["setuptools"]
    assert setuptools["py-modules"] == FIVE and all(os.path.isfile(os.path.join(ROOT, f"{n}.py")) for n in FIVE)
    packages = {os.path.relpath(folder, ROOT).replace(os.sep, ".") for top in ("harness", "tools")
                for folder, _, files in os.walk(os.path.join(ROOT, top)) if "__init__.py" in files}
    include = setuptools["packages"]["find"]["include"]
    assert {"harness", "tools"} <= packages   # and tools.course, but a student copy leaves it out
    assert all(any(fnmatch.fnmatch(p, pattern) for pattern in include) for p in packages)
    assert not any(fnmatch.fnmatch(p, pattern) for p in ("tests", "cache", "results", "docs") for pattern in include)
    assert config["project"]["dynamic"] == ["dependencies"] and "dependencies" not in config["project"]
    assert setuptools["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}   # one list of dependencies
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:   # each line one requirement
        names = {re.match(r"[A-Za-z0-9_.-]+", line).group(0) for line in f if line.split("#")[0].strip()}
    assert names >= {"torch", "transformers", "peft", "pyyaml"}
    assert config["project"]["requires-python"] == ">=3.11"


def test_from_another_folder_the_warm_starts_come_from_the_clone_and_runs_go_here(tmp_path, monkeypatch):
    import scope
    from harness.data import toy
    from harness.run import export, preflight, wiring

    monkeypatch.chdir(tmp_path)
    assert wiring.CACHE_DIR == os.path.join(ROOT, "cache") and export.ROOT == ROOT
    assert os.path.isdir(toy.cache_path(wiring.CACHE_DIR, seed=0))   # shipped: no warm start is trained anew
    assert preflight.run_dir_of(scope.parse_args(["--toy"])) == os.path.join("runs", "scope-toy-s0")
