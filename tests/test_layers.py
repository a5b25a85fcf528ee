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


def test_the_check_sees_a_lazy_import(tmp_path):
    """The parser finds an import inside a function body and an importlib call (the check could fail)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from refine import Refiner\n    import importlib\n"
                    "    return importlib.import_module('prm')\n")
    assert {m for _, m in imported_modules(str(path))} >= {"refine", "prm"}
