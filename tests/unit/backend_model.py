"""A backend's model.py loaded as a module of its own: every backend's file is named model.py
(Triton loads each in a stub of its own), so a plain import would give all tests the first one.
The modules beside a model.py come from pytest's pythonpath (pyproject.toml), as Triton puts its folder there."""

import importlib.util
import pathlib

BACKENDS = pathlib.Path(__file__).resolve().parents[2] / "backends"


def load_model(backend):
    """backends/<backend>/model.py as the module "<backend>_model", executed afresh on each call."""
    spec = importlib.util.spec_from_file_location(f"{backend}_model", BACKENDS / backend / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
