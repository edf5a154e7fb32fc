"""The dependency rules that the folder layout stands for, checked on every
Python file's imports (README.md, "What runs where"):

- backends/<name>/ imports only the standard library, third-party packages,
  triton_python_backend_utils and its own folder's modules: Triton loads it
  alone;
- serving/ (ships in the image beside tritonserver) imports only the standard
  library and itself: the container's system Python runs it;
- classify_describe/ (the pip-installable client) imports only the standard
  library, its declared dependencies and itself;
- nothing outside tests/ imports tests/, and shipped code never imports tools/;
- no file edits sys.path: the layout and pytest's `pythonpath` (pyproject.toml)
  say where modules come from.
"""

import ast
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = sorted(p.parent for p in (REPO / "backends").glob("*/model.py"))
BACKEND_MODULES = {p.stem for b in BACKENDS for p in b.glob("*.py")}
REPO_PACKAGES = {"serving", "tools", "tests", "scripts", "classify_describe", "backends"}
STDLIB = set(sys.stdlib_module_names)


def python_files(*folders):
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported(path):
    """Top-level names of what a file imports (relative imports as '.')."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def first_party(names):
    return {n for n in names if n in REPO_PACKAGES or n in BACKEND_MODULES}


def test_the_layout_has_the_folders_the_rules_name():
    assert BACKENDS and {"openai_describe", "image_preprocess", "torchscript_classifier"} <= {b.name for b in BACKENDS}
    for folder in ("serving", "tools", "scripts", "tests", "classify_describe", "model_repository"):
        assert (REPO / folder).is_dir(), folder


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda p: p.name)
def test_a_backend_imports_nothing_from_the_rest_of_the_repository(backend):
    own = {p.stem for p in backend.glob("*.py")}
    for path in backend.glob("*.py"):
        foreign = first_party(imported(path)) - own
        assert not foreign, f"{path.relative_to(REPO)} imports {sorted(foreign)}"


def test_serving_uses_the_standard_library_only():
    for path in python_files("serving"):
        other = imported(path) - STDLIB - {"serving"}
        assert not other, f"{path.relative_to(REPO)} imports {sorted(other)}: serving/ ships with the system Python"


def test_the_client_imports_only_itself_and_its_declared_dependencies():
    allowed = STDLIB | {"classify_describe", ".", "aiohttp", "numpy", "tritonclient"}
    for path in python_files("classify_describe"):
        other = imported(path) - allowed
        assert not other, f"{path.relative_to(REPO)} imports {sorted(other)}; declare it in pyproject.toml"


def test_nothing_imports_tests_and_shipped_code_never_imports_tools():
    for path in python_files("backends", "serving", "classify_describe", "tools", "scripts"):
        names = imported(path)
        assert "tests" not in names, f"{path.relative_to(REPO)} imports tests/"
        if path.parts[len(REPO.parts)] != "tools":
            assert "tools" not in names, f"{path.relative_to(REPO)} imports tools/, which does not ship"


def edits_sys_path(tree):
    """sys.path.insert/append/extend(...) or an assignment to sys.path."""
    def is_sys_path(node):
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend") and is_sys_path(node.func.value)):
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                return True
    return False


def test_no_file_edits_sys_path():
    assert edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')"))  # the check itself can fail
    for path in python_files("backends", "serving", "classify_describe", "tools", "scripts", "tests"):
        assert not edits_sys_path(ast.parse(path.read_text(), str(path))), f"{path.relative_to(REPO)} edits sys.path"
