"""Unit tests run without a server: a fake triton_python_backend_utils is
installed before any backend module is imported."""


import fake_pb_utils
import pytest

pb_utils = fake_pb_utils.install()


@pytest.fixture
def fake_pb_utils_module():
    fake_pb_utils.Logger.records.clear()
    return pb_utils


@pytest.fixture(scope="session", autouse=True)
def busy_boards_apart(tmp_path_factory):
    """The models' busy boards (classify_describe_server.busy_board) in a folder of this run,
    not /dev/shm: a run stopped inside an execution must not leave a flag a later run sees."""
    from classify_describe_server import busy_board

    folder = str(tmp_path_factory.mktemp("busy_boards"))
    real, busy_board.default_directory = busy_board.default_directory, lambda: folder
    yield
    busy_board.default_directory = real
