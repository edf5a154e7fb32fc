"""The Triton-free logic of a backend (backends/<name>/<module>.py), for tools
that measure it in-process. Backends are not packages (Triton puts a
backend's folder on sys.path when it loads its model.py), so a module is
loaded by path under a name of its own, `<backend>.<module>`; the logic
modules import nothing from their folder, which makes that enough."""

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
        spec.loader.exec_module(loaded)
    return sys.modules[name]
