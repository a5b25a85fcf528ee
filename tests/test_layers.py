"""The layers: harness/ is the engine under the five top-level files (the paper) and imports none of them, nor
tools/ (the studies and the course, which sit on top of both); the modules of tools/ import each other one way."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHOD_FILES = {"scope", "prm", "refine", "grpo", "eval"}


def imported_modules(path: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in the file, at any depth (lazy imports inside functions too)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value).split(".")[0]))
    return out


def test_harness_imports_nothing_from_the_method_files():
    """Every harness/*.py, parsed: no `import grpo`, `from refine import ...`, lazy or not, nor importlib of them."""
    harness = os.path.join(ROOT, "harness")
    found = [f"harness/{name}:{line}: {module}" for name in sorted(os.listdir(harness)) if name.endswith(".py")
             for line, module in imported_modules(os.path.join(harness, name)) if module in METHOD_FILES]
    assert not found, "harness/ imports the method files:\n" + "\n".join(found)


def test_harness_imports_nothing_from_tools():
    """Every harness/*.py, parsed: no `import tools...` or `from tools... import ...`, lazy or not."""
    harness = os.path.join(ROOT, "harness")
    found = [f"harness/{name}:{line}: {module}" for name in sorted(os.listdir(harness)) if name.endswith(".py")
             for line, module in imported_modules(os.path.join(harness, name)) if module == "tools"]
    assert not found, "harness/ imports tools/:\n" + "\n".join(found)


def package_imports(root: str, package: str) -> dict:
    """{module file: {imported module file: line}} among the .py files of the folder root/package, subpackages
    included, from every import at any depth: `from tools import x`, `import tools.x`, `from tools.x import y`
    and relative imports (`from .x import y`). Files are named relative to `root`."""
    files = {}   # dotted module name -> file
    for folder, _, names in os.walk(os.path.join(root, package)):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)
                files[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = rel
    graph = {}
    for module, rel in files.items():
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        here = module if rel.endswith("__init__.py") else module.rpartition(".")[0]   # its package
        edges = graph.setdefault(rel, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                source = ".".join(part for part in (base, node.module) if part)
                targets = [f"{source}.{alias.name}" for alias in node.names]   # a module, or a name in `source`
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target:
                    edges.setdefault(files[target], node.lineno)
    return graph


def import_cycles(graph: dict) -> list[list[str]]:
    """One cycle (its files, the first repeated at the end) for each back edge of a depth-first walk: none
    when the imports run one way."""
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in graph.get(node, {}):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_tools_modules_import_each_other_one_way():
    """The import graph of tools/ (every import at any depth, lazy ones inside functions too) has no cycle."""
    graph = package_imports(ROOT, "tools")
    # the walk sees the imports among tools/
    assert graph["tools/studies/why_it_helps.py"].keys() >= {"tools/studies/when_it_helps.py"}
    named = [" -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
             for cycle in import_cycles(graph)]
    assert not named, "import cycles among tools/ (file:line of each import):\n" + "\n".join(named)


def test_the_cycle_check_sees_a_lazy_circle(tmp_path):
    """A package whose module a imports b at the top and b imports a inside a function: the walk finds the
    circle a -> b -> a; c's relative import of a is one edge and no circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.a\n    return pkg.a\n")
    (pkg / "c.py").write_text("from .a import f\n")
    graph = package_imports(str(tmp_path), "pkg")
    assert graph["pkg/c.py"] == {"pkg/a.py": 1} and graph["pkg/b.py"] == {"pkg/a.py": 2}
    assert import_cycles(graph) == [["pkg/a.py", "pkg/b.py", "pkg/a.py"]]


def test_the_check_sees_a_lazy_import(tmp_path):
    """The parser finds an import inside a function body and an importlib call (the check could fail)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from refine import Refiner\n    import importlib\n"
                    "    return importlib.import_module('prm')\n")
    assert {m for _, m in imported_modules(str(path))} >= {"refine", "prm"}


def code_lines(path: str, name: str, body_only: bool = False) -> int:
    """Non-blank lines of function `name` in `path` that are not comments; body_only: without its def lines and
    its docstring."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    start = node.lineno
    if body_only:
        first = node.body[1] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
            else node.body[0]
        start = first.lineno
    lines = src.splitlines()[start - 1:node.end_lineno]
    return sum(1 for ln in lines if ln.strip() and not ln.strip().startswith("#"))


def test_the_step_and_the_update_stay_short():
    """The design card's limits: scope.py's main (the whole step, one screen) at most 35 lines besides comments,
    grpo.py's update at most 25 besides its def lines, docstring and comments."""
    main = code_lines(os.path.join(ROOT, "scope.py"), "main")
    update = code_lines(os.path.join(ROOT, "grpo.py"), "update", body_only=True)
    assert main <= 35, f"scope.py:main has {main} lines besides comments (at most 35)"
    assert update <= 25, f"grpo.py:update has {update} lines besides its signature, docstring and comments (at most 25)"
