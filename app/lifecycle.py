"""Process hygiene shared by the supervisor and its children: logging, signals, no orphans."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
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
