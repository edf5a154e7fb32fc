"""Unit tests run without a server: a fake triton_python_backend_utils is
installed before any backend module is imported."""


import fake_pb_utils
import pytest

pb_utils = fake_pb_utils.install()


@pytest.fixture
def fake_pb_utils_module():
    fake_pb_utils.Logger.records.clear()
    return pb_utils
