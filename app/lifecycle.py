"""Process hygiene shared by the supervisor and its children: logging, signals, no orphans."""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import os
import signal
import struct
import sys
import time
from collections.abc import Callable

LOG_FORMAT = "[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
_PR_SET_PDEATHSIG = 1


def configure_logging(level: str, process_name: str) -> None:
    import multiprocessing

    multiprocessing.current_process().name = process_name
    logging.basicConfig(
        level=level.upper(), format=LOG_FORMAT, datefmt=LOG_DATEFMT, stream=sys.stderr, force=True
    )
    # Third-party chatter stays at WARNING whatever our level is.
    for noisy in ("urllib3", "filelock", "huggingface_hub", "transformers", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def init_child(name: str, log_level: str) -> None:
    """Run first in every child: die with the parent, leave Ctrl-C to the supervisor."""
    configure_logging(log_level, name)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def one_line(exc: BaseException) -> str:
    """An exception as one log line: its type and message, newlines folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_child(name: str, log_level: str, target: Callable[..., None], *args: object) -> None:
    """A child's entry: run `target`; an exception it raises (start-up or later) becomes one log line,
    its traceback only at --log-level debug, and exit code 1 at once, so the supervisor sees the
    death within its next poll and names the cause."""
    try:
        target(*args)
    except Exception as exc:
        if not logging.getLogger().handlers:  # it failed before init_child configured logging
            configure_logging(log_level, name)
        log = logging.getLogger("tokenspeed.supervisor")
        if log_level.lower() == "debug":
            log.exception("%s failed", name)
        else:
            log.error("%s failed: %s (--log-level debug shows the traceback)", name, one_line(exc))
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: a thread or a socket's linger must not hold the exit up


def _die_with_parent() -> None:
    # If the supervisor is killed (even with SIGKILL) the kernel sends us SIGKILL: no orphans.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def on_sigterm(callback: Callable[[], None]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: callback())


# ---------------------------------------------------------------- liveness heartbeats

HEARTBEAT_INTERVAL_S = 1.0  # every process loop beats at least this often while it is healthy
# An observer that itself went this long between two looks (its host or VM was paused, it was starved
# of CPU) counts only this much of the gap as silence: it cannot blame a child for time it was not watching.
MAX_UNWATCHED_S = 5.0
_COUNT = struct.Struct("Q")


class Heartbeat:
    """One process's liveness: a beat counter in an 8-byte file of the runtime dir, mapped into memory,
    so a beat is a memory write, not a syscall. The supervisor creates every file before it starts any
    child; the child bumps its counter from its main loop; observers (the supervisor, http's readiness)
    time its silence with a HeartbeatWatch on their own clock. No timestamp crosses processes, so a
    clock that jumps (a paused VM) or a stray value in the file can never read as hours of silence."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _COUNT.size)
        finally:
            os.close(fd)

    @staticmethod
    def path_of(runtime_dir: str, name: str) -> str:
        return os.path.join(runtime_dir, f"heartbeat-{name}")

    @classmethod
    def create(cls, runtime_dir: str, name: str) -> Heartbeat:
        path = cls.path_of(runtime_dir, name)
        with open(path, "wb") as f:
            f.write(_COUNT.pack(0))
        return cls(path)

    @classmethod
    def attach(cls, runtime_dir: str, name: str) -> Heartbeat | None:
        """The heartbeat the supervisor made for `name`; None when there is none (a process run alone)."""
        path = cls.path_of(runtime_dir, name)
        return cls(path) if os.path.exists(path) else None

    def beat(self) -> None:
        _COUNT.pack_into(self._map, 0, (self.count() + 1) % (1 << 64))

    def count(self) -> int:
        return _COUNT.unpack_from(self._map, 0)[0]


class HeartbeatWatch:
    """How long a heartbeat has gone without a beat, timed on the observer's clock: each look compares
    the counter with the previous look's. Silence starts counting when the watch is made."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self._count = heartbeat.count()
        self._looked = time.monotonic()
        self._silent = 0.0

    def silent_for(self) -> float:
        """Seconds without a beat, as of now."""
        now, count = time.monotonic(), self.heartbeat.count()
        if count != self._count:
            self._count, self._silent = count, 0.0
        else:
            self._silent += min(now - self._looked, MAX_UNWATCHED_S)
        self._looked = now
        return self._silent


def settle_heap() -> None:
    """Called once a process is ready: collect, then freeze what is alive (modules, the model's Python
    objects, tokenizer tables) so that the collector's full passes no longer scan it. Unfrozen, a
    generation-2 pass over that heap stalls the serving loop for tens of milliseconds now and then."""
    gc.collect()
    gc.freeze()


def beat(heartbeat: Heartbeat | None) -> None:
    if heartbeat is not None:
        heartbeat.beat()

