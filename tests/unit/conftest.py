"""Unit tests run without a server: a fake triton_python_backend_utils is
installed before any backend module is imported."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import fake_pb_utils  # noqa: E402

pb_utils = fake_pb_utils.install()


@pytest.fixture
def fake_pb_utils_module():
    fake_pb_utils.Logger.records.clear()
    return pb_utils
