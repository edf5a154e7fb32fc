"""The dependency rules that the folder layout stands for, checked on every
Python file's imports (README.md, "What runs where"):

- backends/classify_describe_server/ (the installed package of Triton-free logic)
  imports only the standard library, third-party packages and itself, never
  triton_python_backend_utils;
- backends/<name>/ (a Triton adapter) imports only the standard library,
  third-party packages, the package and its own folder's modules: Triton loads it
  alone; only model.py and a Triton I/O module beside it import
  triton_python_backend_utils;
- serving/ (ships in the image beside tritonserver) imports only the standard
  library and itself: the container's system Python runs it;
- classify_describe/ (the pip-installable client) imports only the standard
  library, its declared dependencies and itself;
- openai_front/ (ships in the image, started by the supervisor) imports only
  the standard library, the runtime requirements it talks through (aiohttp,
  tritonclient, grpc, numpy), the package's contract modules (error contract,
  request ids, config, the describe step's limits) and itself: no model code,
  no image decoding;
- nothing outside tests/ imports tests/, and shipped code never imports tools/;
- no file edits sys.path: the layout and pytest's `pythonpath` (pyproject.toml)
  say where modules come from;
- no symlink anywhere in the tree.
"""

import ast
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = sorted(p.parent for p in (REPO / "backends").glob("*/model.py"))
BACKEND_MODULES = {p.stem for b in BACKENDS for p in b.rglob("*.py")}
PACKAGE = "classify_describe_server"
REPO_PACKAGES = {"serving", "tools", "tests", "scripts", "classify_describe", "backends", "openai_front", PACKAGE}
# What the front may use of the package: the two sides of the error contract and request ids, the ConfigError,
# and the describe step's limits and roles, which it checks first.
FRONT_USES = {"error_contract", "request_id", "config", "settings", "dialogue"}
TRITON = "triton_python_backend_utils"
# serving/ runs under the container's system Python (3.10 in the NGC 24.10 image):
# modules that came later do not count as standard library there.
STDLIB = set(sys.stdlib_module_names) - {"tomllib", "_tomllib", "wsgiref.types"}
TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("*.py")} - {"__init__", "conftest"}


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


def package_modules(path):
    """The modules of the package a file imports (`from PACKAGE import x`, `from PACKAGE.x import y`)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            parts = node.module.split(".")
            used.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
    return used


def first_party(names):
    """Names that resolve to this repository: its packages, the backends'
    modules, and the tests' modules (tests/unit is on pytest's pythonpath)."""
    return {n for n in names if n in REPO_PACKAGES or n in BACKEND_MODULES or n in TEST_MODULES}


def test_the_layout_has_the_folders_the_rules_name():
    assert {b.name for b in BACKENDS} == {"openai_describe", "image"}
    for folder in ("serving", "tools", "scripts", "tests", "classify_describe", "model_repository", "openai_front",
                   f"backends/{PACKAGE}"):
        assert (REPO / folder).is_dir(), folder


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda p: p.name)
def test_a_backend_imports_only_its_folder_and_the_package(backend):
    own = {p.stem for p in backend.rglob("*.py")}
    for path in backend.rglob("*.py"):
        foreign = first_party(imported(path)) - own - {PACKAGE}
        assert not foreign, f"{path.relative_to(REPO)} imports {sorted(foreign)}"


def test_only_a_model_py_and_its_triton_io_touch_triton():
    touching = sorted(p.relative_to(REPO).as_posix() for p in python_files("backends", "openai_front", "serving",
                                                                          "classify_describe")
                      if TRITON in imported(p))
    assert touching == ["backends/image/model.py", "backends/openai_describe/model.py",
                        "backends/openai_describe/triton_io.py"]


def test_the_package_imports_only_itself_and_libraries():
    for path in python_files(f"backends/{PACKAGE}"):
        names = imported(path)
        assert TRITON not in names, f"{path.relative_to(REPO)} imports Triton: the package runs without it"
        foreign = first_party(names) - {"."}
        assert not foreign, f"{path.relative_to(REPO)} imports {sorted(foreign)}: the package stands alone"


def test_serving_uses_the_standard_library_only():
    for path in python_files("serving"):
        other = imported(path) - STDLIB - {"serving"}
        assert not other, f"{path.relative_to(REPO)} imports {sorted(other)}: serving/ ships with the system Python"


def test_the_client_imports_only_itself_and_its_declared_dependencies():
    allowed = STDLIB | {"classify_describe", ".", "aiohttp", "numpy", "tritonclient"}
    for path in python_files("classify_describe"):
        other = imported(path) - allowed
        assert not other, f"{path.relative_to(REPO)} imports {sorted(other)}; declare it in pyproject.toml"


def test_the_openai_front_talks_to_triton_and_nothing_else():
    # prometheus_client: its own /metrics, in the standard exposition; orjson and pybase64: the body's
    # JSON and the photo's decode.
    allowed = STDLIB | {"openai_front", ".", "aiohttp", "tritonclient", "grpc", "numpy", "prometheus_client",
                        "pybase64", "orjson", PACKAGE}
    for path in python_files("openai_front"):
        other = imported(path) - allowed
        assert not other, f"{path.relative_to(REPO)} imports {sorted(other)}: the front forwards to Triton, nothing more"
        used = package_modules(path)
        assert used <= FRONT_USES, f"{path.relative_to(REPO)} uses {sorted(used - FRONT_USES)} of {PACKAGE}"


def test_nothing_imports_tests_and_shipped_code_never_imports_tools():
    for path in python_files("backends", "serving", "classify_describe", "openai_front", "tools", "scripts"):
        names = imported(path)
        assert not names & ({"tests"} | TEST_MODULES), f"{path.relative_to(REPO)} imports tests/"
        if path.parts[len(REPO.parts)] != "tools":
            assert "tools" not in names, f"{path.relative_to(REPO)} imports tools/, which does not ship"
            # Nor by name at run time (importlib, `python -m tools.x` in a subprocess).
            strings = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
                       and isinstance(n.value, str)]
            assert not [s for s in strings if s.startswith(("tools.", "tests."))], path.relative_to(REPO)


def test_no_installed_package_shadows_a_backend_module():
    """Triton's stub appends a backend's folder to sys.path: an installed module
    with the same name as one of ours would be imported instead."""
    import subprocess

    names = sorted(BACKEND_MODULES - {"model"})
    found = subprocess.run([sys.executable, "-I", "-c", "import importlib.util, sys; "
                            "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n)))", *names],
                           cwd="/", capture_output=True, text=True, check=True).stdout.split()
    assert found == [], f"installed packages shadow backend modules: {found}"


def edits_sys_path(tree):
    """sys.path.insert/append/extend(...), an assignment to sys.path or a slice
    of it, `from sys import path`, or site.addsitedir(...)."""
    def is_sys_path(node):
        if isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "addsitedir"):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend") and is_sys_path(node.func.value)):
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                return True
    return False


def test_no_file_edits_sys_path():
    for edit in ("sys.path.insert(0, 'x')", "sys.path[:0] = ['x']", "from sys import path",
                 "import site; site.addsitedir('x')", "sys.path = []"):
        assert edits_sys_path(ast.parse(f"import sys\n{edit}")), edit  # the check itself can fail
    for path in python_files("backends", "serving", "classify_describe", "tools", "scripts", "tests"):
        assert not edits_sys_path(ast.parse(path.read_text(), str(path))), f"{path.relative_to(REPO)} edits sys.path"


def test_no_symlink_anywhere_in_the_tree():
    """Shared code is imported from the package, never linked into a folder."""
    import subprocess

    staged = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in staged.splitlines() if line.startswith("120000 ")]
    assert links == [], f"symlinks in the tree: {links}"
