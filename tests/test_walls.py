"""The house's walls: harness/ in wings by job (data < engines < plan < run), the five method files above them and
tools/ on top. An import may go sideways or down, never up, and never round in a circle; imports inside functions
count (the graph is read from the source, not from what happens to load)."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINGS = ("harness.data", "harness.engines", "harness.plan", "harness.run")   # bottom to top
METHOD = ("grpo", "prm", "refine", "scope", "eval")
MOST_MODULES = 12


def project_modules() -> dict[str, str]:
    """Dotted name -> file of every module of harness/, tools/ and the five method files."""
    found = {name: os.path.join(ROOT, name + ".py") for name in METHOD}
    for top in ("harness", "tools"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    found[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return found


def imports_of(name: str, path: str, modules: dict) -> set[str]:
    """The project modules `name` imports anywhere in its file (top level or inside a function)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def level(name: str) -> int:
    """0-3: the wings bottom to top; 4: harness/__init__; 5: a method file; 6: tools."""
    for i, wing in enumerate(WINGS):
        if name == wing or name.startswith(wing + "."):
            return i
    return 4 if name == "harness" else 5 if name in METHOD else 6


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_projects_modules():
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_wing_imports_one_above_it_and_the_engine_imports_no_method_file():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if level(a) <= 4 and level(b) > level(a)]
    assert upward == []


def test_every_module_is_in_a_wing_and_no_folder_holds_more_than_a_dozen():
    modules = project_modules()
    stray = [m for m in modules if m.startswith("harness.") and level(m) == 6]
    assert stray == [], "a harness module outside the four wings"
    per_folder = {}
    for path in modules.values():
        if not path.endswith("__init__.py"):
            per_folder.setdefault(os.path.relpath(os.path.dirname(path), ROOT), []).append(path)
    crowded = {folder: len(files) for folder, files in per_folder.items() if len(files) > MOST_MODULES}
    assert crowded == {}


def test_the_walls_test_reads_function_level_imports():
    edges = graph()
    assert "harness.data.toy" in edges["harness.data.problems"]   # `from harness.data import toy` inside a function
    assert "harness.engines.generate" in edges["harness.run.wiring"]


def test_the_method_files_load_no_run_machinery():
    """`import prm, refine, grpo` (what a reader or a notebook imports for the method) loads no command line,
    pre-flight, run folder or tracker, statically or in fact."""
    edges = graph()
    seen, todo = set(), ["prm", "refine", "grpo"]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert sorted(m for m in seen if level(m) in (2, 3)) == []
    code = "import sys, prm, refine, grpo; print(sorted(m for m in sys.modules if m.startswith(('harness.run', 'harness.plan'))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
