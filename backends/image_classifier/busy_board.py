"""Which instances of one tritonserver are busy now, across their stub processes.

Each Python-backend instance is its own process, and Triton's rate limiter does not tell a model
how many of its "cpu" slots are taken. The board does: a small file in shared memory mapped by
every instance of the server that joins it (classify_with_view's), one slot per instance with
its PID, whether it is executing, and when it last finished. A forward pass that starts while
every other instance is idle may use the idle core as well (parameter idle_intra_op_threads,
docs/benchmarks-method.md#where-the-cpu-goes).

"Idle" means not executing and not finished within the last SETTLE_NS: under load an instance
is between two executions for well under a millisecond (its answer goes out, the next request
comes in), and a neighbour that starts a wide pass in that gap would take the core back from
it. A lone request instead finds the others idle since the previous answer went to the client.

Reads and writes are plain stores to shared memory: no lock on the request path. A race costs
at most one forward pass run wide beside a busy neighbour, never a wrong answer. A stub that
dies mid-execution leaves its flag set: its neighbours then stay on one thread (the layout
without the board) until a new stub takes the slot back.
"""

import contextlib
import fcntl
import mmap
import os
import pathlib
import tempfile
import time

import numpy as np

SLOTS = 64  # instances of one server that can join; past that an instance runs narrow
SLOT = np.dtype([("pid", "<u4"), ("executing", "u1"), ("spare", "u1", 3), ("finished_ns", "<i8")])
SETTLE_NS = 2_000_000  # 2 ms: a neighbour that finished this recently is likely between two executions


def default_directory():
    """Shared memory where there is some (Linux, the Triton container); a temp folder elsewhere."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class BusyBoard:
    """The board `name` of the server `server_pid` (by default the stub's parent: tritonserver).
    `clock` gives nanoseconds that every process of the machine shares (CLOCK_MONOTONIC)."""

    def __init__(self, name, server_pid=None, directory=None, pid=None, clock=time.monotonic_ns):
        server_pid = os.getppid() if server_pid is None else server_pid
        directory = pathlib.Path(directory or default_directory())
        self.pid = os.getpid() if pid is None else pid
        self.clock = clock
        self.path = directory / f"triton-{server_pid}-{name}.busy"
        self.slots, self.slot, self.error = None, None, None
        try:
            remove_stale(directory, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:  # no shared folder we may write: off the board, every pass narrow
            self.error = f"busy board {self.path} unavailable ({error.strerror}): one thread per pass"
            return
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)  # instances load in parallel: claim slots one at a time
            if os.fstat(fd).st_size < SLOTS * SLOT.itemsize:
                os.ftruncate(fd, SLOTS * SLOT.itemsize)
            self._map = mmap.mmap(fd, SLOTS * SLOT.itemsize)  # keeps its own reference to the file
            self.slots = np.frombuffer(self._map, dtype=SLOT, count=SLOTS)
            self.slot = self._claim()
            if self.slot is None:
                self.error = f"busy board {self.path} full ({SLOTS} instances): one thread per pass"
        finally:
            os.close(fd)  # also releases the lock

    def _claim(self):
        """Frees the slots of stubs that are gone (a flag left set would count as busy forever),
        then takes the first free one; None when all are taken. A process has one place on a
        board: a second board of the same process (only in tests) shares it."""
        for slot in range(SLOTS):
            owner = int(self.slots[slot]["pid"])
            if owner and owner != self.pid and not alive(owner):
                self.slots[slot] = 0
        mine = np.flatnonzero(self.slots["pid"] == self.pid)
        if len(mine):
            return int(mine[0])
        free = np.flatnonzero(self.slots["pid"] == 0)
        if not len(free):
            return None
        self.slots[free[0]] = (self.pid, 0, 0, 0)
        return int(free[0])

    def others_busy(self):
        """How many other instances on the board are executing or finished within SETTLE_NS; off
        the board (see `error`) any neighbour may be, so SLOTS."""
        if self.slot is None:
            return SLOTS
        busy = (self.slots["executing"] == 1) | (self.clock() - self.slots["finished_ns"] < SETTLE_NS)
        busy[self.slot] = False
        return int(np.count_nonzero(busy))

    @contextlib.contextmanager
    def executing(self):
        """with board.executing(): ... marks this instance busy inside the block."""
        if self.slot is None:
            yield
            return
        mine = self.slots[self.slot:self.slot + 1]
        mine["executing"] = 1
        try:
            yield
        finally:
            mine["finished_ns"] = self.clock()
            mine["executing"] = 0

    def close(self):
        if self.slots is None:
            return
        if self.slot is not None:
            self.slots[self.slot] = 0
        self.slots = None  # the array holds the map's buffer: it must go before the map closes
        self._map.close()


def remove_stale(directory, name):
    """Boards of servers that are gone (their PID is in the file's name): one file per server
    start would otherwise pile up in /dev/shm."""
    for path in directory.glob(f"triton-*-{name}.busy"):
        server = path.name.split("-")[1]
        if server.isdigit() and not alive(int(server)):
            try:
                path.unlink()
            except OSError:  # another instance removed it first, or it is not ours
                pass


CPU_BOARD = "cpu"  # the instances that hold a slot of Triton's "cpu" rate-limit resource


def join_board(log, name=CPU_BOARD):
    """This stub's place on its server's board; a board it cannot join is logged, not fatal."""
    board = BusyBoard(name)
    if board.error:
        log.warn(board.error)
    return board
