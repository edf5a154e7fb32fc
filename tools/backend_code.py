"""The Triton-free logic of a backend (backends/<name>/<module>.py), for tools
that measure it in-process. Backends are not packages (Triton puts a
backend's folder on sys.path when it loads its model.py), so a module is
loaded by path under a name of its own, `<backend>.<module>`, with the folder
on sys.path while it runs, as Triton has it, for the sibling modules it
imports (prompting imports settings)."""

import importlib.util
import pathlib
import sys

BACKENDS = pathlib.Path(__file__).resolve().parents[1] / "backends"


def load(backend, module):
    name = f"{backend}.{module}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BACKENDS / backend / f"{module}.py")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # before running it: dataclasses look their module up
        sys.path.insert(0, str(BACKENDS / backend))
        try:
            spec.loader.exec_module(loaded)
        finally:
            sys.path.remove(str(BACKENDS / backend))
    return sys.modules[name]
