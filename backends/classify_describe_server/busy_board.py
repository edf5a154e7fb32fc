"""Which instances of one tritonserver are busy now, across their stub processes.

Each Python-backend instance is its own process, and Triton's rate limiter does not tell a model
how many of its "cpu" slots are taken. The board does: a small file in shared memory mapped by
every instance that holds such a slot (classify_with_view's, preprocess's and the classifier's),
one slot per instance with its PID, whether it is executing, since when, and when it last
finished. A forward pass that starts while every other instance is idle may use the idle core
as well (parameter idle_intra_op_threads, docs/benchmarks-method.md#where-the-cpu-goes).

"Idle" means not executing and not finished within the last SETTLE_NS: under load an instance
is between two executions for well under a millisecond (its answer goes out, the next request
comes in), and a neighbour that starts a wide pass in that gap would take the core back from
it. A lone request instead finds the others idle since the previous answer went to the client.

Reads and writes are plain stores to shared memory: no lock on the request path. A race costs
at most one forward pass run wide beside a busy neighbour (its worker spinning between ops, so
taking that core for the pass), never a wrong answer. A flag left
set by a stub that died mid-execution counts for STALE_NS at most (no execution takes that
long): the neighbours run narrow meanwhile, the layout without the board. Anything wrong with
the board itself (no shared folder, a file that is not ours) leaves the instance off it, narrow.
"""

import contextlib
import fcntl
import mmap
import os
import pathlib
import stat
import tempfile
import time

import numpy as np

SLOTS = 64  # instances of one server that can join; past that an instance runs narrow
SLOT = np.dtype([("pid", "<u4"), ("executing", "u1"), ("spare", "u1", 3),
                 ("started_ns", "<i8"), ("finished_ns", "<i8")])
SETTLE_NS = 2_000_000  # 2 ms: a neighbour that finished this recently is likely between two executions
STALE_NS = 10_000_000_000  # 10 s: an "executing" flag this old was left by a stub that died


def default_directory():
    """Shared memory where there is some (Linux, the Triton container); a temp folder elsewhere."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def process_start(pid):
    """When a process started (clock ticks since boot, /proc/<pid>/stat field 22), None when it is
    gone or a zombie: Triton 2.51 leaves a killed stub a zombie (docs/reliability.md). The twin of
    serving/procfs.process_state, which a backend cannot import (they ship apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] == "Z" else int(fields[19])


class BusyBoard:
    """The board `name` of the server `server_pid` (by default the stub's parent: tritonserver).
    `clock` gives nanoseconds that every process of the machine shares (CLOCK_MONOTONIC)."""

    def __init__(self, name, server_pid=None, directory=None, pid=None, clock=time.monotonic_ns):
        self.pid = os.getpid() if pid is None else pid
        self.clock = clock
        self.slots, self.slot, self.error = None, None, None
        try:
            server_pid = os.getppid() if server_pid is None else server_pid
            directory = pathlib.Path(directory or default_directory())
            # The server's start time in the name: a restarted server (a container restart keeps
            # the pod's /dev/shm) may get the same PID, never the same PID and start time.
            self.path = directory / f"triton-{server_pid}-{process_start(server_pid)}-{name}.busy"
            remove_stale(directory, name)
            fd = self._open(SLOTS * SLOT.itemsize)
            try:
                self._map = mmap.mmap(fd, SLOTS * SLOT.itemsize)  # keeps its own reference to the file
                self.slots = np.frombuffer(self._map, dtype=SLOT, count=SLOTS)
                self.slot = self._claim()
            finally:
                os.close(fd)  # also releases the lock
            if self.slot is None:
                self.error = f"busy board {self.path} full ({SLOTS} instances): one thread per pass"
        except (OSError, ValueError, OverflowError) as error:
            self.slots, self.slot = None, None
            self.error = f"busy board unavailable ({error}): one thread per pass"

    def _open(self, size):
        """The board's file, locked and sized; a file that is not a plain file of ours (a link,
        another user's) is refused, so a local user cannot steer or break it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)  # instances load in parallel: claim slots one at a time
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
                raise ValueError(f"{self.path} is not a plain file of this user")
            if info.st_size < size:
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS on a store
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _claim(self):
        """Frees the slots of stubs that are gone, then takes the first free one; None when all
        are taken. A process has one place on a board: a second board of the same process (only
        in tests) shares it."""
        for slot in range(SLOTS):
            owner = int(self.slots[slot]["pid"])
            if owner and process_start(owner) is None:
                self.slots[slot] = 0
        mine = np.flatnonzero(self.slots["pid"] == self.pid)
        if len(mine):
            return int(mine[0])
        free = np.flatnonzero(self.slots["pid"] == 0)
        if not len(free):
            return None
        self.slots[free[0]] = (self.pid, 0, 0, 0, 0)
        return int(free[0])

    def others_busy(self):
        """How many other instances on the board are executing (for less than STALE_NS) or
        finished within SETTLE_NS; off the board (see `error`) any neighbour may be, so SLOTS."""
        if self.slot is None:
            return SLOTS
        now = self.clock()
        slots = self.slots
        busy = ((slots["executing"] == 1) & (now - slots["started_ns"] < STALE_NS)) | \
               (now - slots["finished_ns"] < SETTLE_NS)
        busy[self.slot] = False
        return int(np.count_nonzero(busy))

    @contextlib.contextmanager
    def executing(self):
        """with board.executing(): ... marks this instance busy inside the block."""
        if self.slot is None:
            yield
            return
        mine = self.slots[self.slot:self.slot + 1]
        mine["started_ns"] = self.clock()
        mine["executing"] = 1
        try:
            yield
        finally:
            mine["finished_ns"] = self.clock()  # before the flag drops: never seen idle in between
            mine["executing"] = 0

    def close(self):
        if self.slots is None:
            return
        if self.slot is not None:
            self.slots[self.slot] = 0
        self.slots, self.slot = None, None  # the array holds the map's buffer: it goes first
        self._map.close()


def remove_stale(directory, name):
    """Boards of servers that are gone (their PID and start time are in the file's name): one file
    per server start would otherwise pile up in /dev/shm."""
    for path in directory.glob(f"triton-*-*-{name}.busy"):
        server, started = path.name.split("-")[1:3]
        if server.isdigit() and started != str(process_start(int(server))):
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
