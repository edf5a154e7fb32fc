"""classify_describe_server.busy_board: whether the other instances of a server are busy, across
processes, so a forward pass takes the idle core only when it is idle (idle_intra_op_threads)."""

import os
import subprocess
import sys
import time

import pytest
from classify_describe_server import busy_board

SERVER = os.getppid()  # any live PID stands for the server: its board outlives no one here


class Clock:
    """Nanoseconds the test moves by hand: the settle window without sleeping."""

    def __init__(self):
        self.now = 10**12

    def __call__(self):
        return self.now


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def boards(tmp_path, clock):
    """Two instances of one server: this process and another live one (the test runner's parent)."""
    mine = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    neighbour = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, pid=os.getppid(), clock=clock)
    yield mine, neighbour
    mine.close()
    neighbour.close()


def test_a_neighbour_counts_while_it_executes_and_just_after(boards, clock):
    mine, neighbour = boards
    assert (mine.slot, neighbour.slot) == (0, 1) and mine.error is None
    assert mine.others_busy() == 0
    with neighbour.executing():
        assert mine.others_busy() == 1
        assert neighbour.others_busy() == 0  # its own flag is not a neighbour
    # Between two executions under load: still busy for SETTLE_NS, then idle.
    clock.now += busy_board.SETTLE_NS - 1
    assert mine.others_busy() == 1
    clock.now += 1
    assert mine.others_busy() == 0


def test_its_own_execution_does_not_count(boards):
    mine, _ = boards
    with mine.executing():
        assert mine.others_busy() == 0


def test_the_flag_is_cleared_when_the_block_raises(boards, clock):
    mine, neighbour = boards
    with pytest.raises(RuntimeError), neighbour.executing():
        raise RuntimeError("a failed execution")
    clock.now += busy_board.SETTLE_NS
    assert mine.others_busy() == 0


def test_boards_of_other_servers_and_names_are_apart(tmp_path, clock):
    mine = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    other_server = busy_board.BusyBoard("cpu", server_pid=os.getpid(), directory=tmp_path, pid=os.getppid(), clock=clock)
    other_name = busy_board.BusyBoard("gpu", server_pid=SERVER, directory=tmp_path, pid=os.getppid(), clock=clock)
    with other_server.executing(), other_name.executing():
        assert mine.others_busy() == 0


def test_a_dead_stub_left_executing_is_cleared_and_its_slot_reused(tmp_path, clock):
    """A stub killed mid-execution leaves its flag set; the next stub to join frees the slot."""
    gone = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, pid=dead_pid(), clock=clock)
    left_inside = gone.executing()  # held: a context manager collected would leave its block
    left_inside.__enter__()  # and never leaves
    assert gone.slots[0]["executing"] == 1
    mine = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    clock.now += busy_board.SETTLE_NS
    assert mine.slot == 0 and mine.others_busy() == 0


def test_a_full_board_leaves_the_instance_off_it_and_narrow(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(busy_board, "SLOTS", 1)
    first = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, pid=os.getppid(), clock=clock)
    second = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    assert first.slot == 0 and second.slot is None and "full" in second.error
    assert second.others_busy() > 0  # it cannot know: never wide
    with second.executing():  # harmless
        assert first.others_busy() == 0


def test_a_folder_it_cannot_write_leaves_the_instance_off_the_board(tmp_path, clock):
    board = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path / "missing", clock=clock)
    assert board.slot is None and "unavailable" in board.error
    assert board.others_busy() > 0
    with board.executing():
        pass
    board.close()


def test_close_frees_the_slot(tmp_path, clock):
    first = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, pid=os.getppid(), clock=clock)
    first.close()
    second = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    assert second.slot == 0


def test_boards_of_servers_that_are_gone_or_restarted_are_removed(tmp_path, clock):
    started = busy_board.process_start(SERVER)
    gone = tmp_path / f"triton-{dead_pid()}-{started}-cpu.busy"
    restarted = tmp_path / f"triton-{SERVER}-{started - 1}-cpu.busy"  # the same PID, started earlier
    live = tmp_path / f"triton-{SERVER}-{started}-cpu.busy"
    odd = tmp_path / "triton-x-1-cpu.busy"  # not a server's name: left alone, no crash
    for path in (gone, restarted, live, odd):
        path.write_bytes(b"")
    busy_board.BusyBoard("cpu", server_pid=os.getpid(), directory=tmp_path, clock=clock).close()
    assert not gone.exists() and not restarted.exists() and live.exists() and odd.exists()


def test_a_zombie_stub_left_executing_is_cleared(tmp_path, clock):
    """Triton 2.51 leaves a killed stub a zombie: alive to kill(pid, 0), gone to the board."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, pid=child.pid, clock=clock)
        left_inside = zombie.executing()  # held: a context manager collected would leave its block
        left_inside.__enter__()
        assert zombie.slots[0]["executing"] == 1
        child.kill()
        deadline = time.monotonic() + 30
        while busy_board.process_start(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the kernel has made it a zombie (it is not reaped: no wait())
        mine = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
        assert mine.slot == 0 and mine.others_busy() == 0
    finally:
        child.wait()


def test_an_executing_flag_older_than_any_execution_stops_counting(boards, clock):
    """A stub that died mid-execution and whose PID lives on (reused): its flag counts STALE_NS at most."""
    mine, neighbour = boards
    left_inside = neighbour.executing()  # held: a context manager collected would leave its block
    left_inside.__enter__()  # and never leaves
    clock.now += busy_board.STALE_NS - 1
    assert mine.others_busy() == 1
    clock.now += 1
    assert mine.others_busy() == 0


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_board_file_that_is_not_a_plain_file_of_ours_is_refused(tmp_path, clock, plant):
    """Its name is predictable: another local user could plant a link to steer or break it."""
    board_name = f"triton-{SERVER}-{busy_board.process_start(SERVER)}-cpu.busy"
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(busy_board.SLOTS * busy_board.SLOT.itemsize))
    (tmp_path / board_name).symlink_to(target) if plant == "symlink" else os.link(target, tmp_path / board_name)
    board = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    assert board.slot is None and "unavailable" in board.error
    assert target.read_bytes() == bytes(busy_board.SLOTS * busy_board.SLOT.itemsize)  # untouched


def test_after_close_the_board_is_off_and_harmless(tmp_path, clock):
    board = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    board.close()
    with board.executing():
        assert board.others_busy() == busy_board.SLOTS
    board.close()


def test_a_process_has_one_place_on_a_board(tmp_path, clock):
    first = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    second = busy_board.BusyBoard("cpu", server_pid=SERVER, directory=tmp_path, clock=clock)
    assert first.slot == second.slot == 0
