"""Triton kernels run on the CPU here, through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set while this package is collected
(its test modules import the kernels; modules imported earlier in the session are reloaded), set
again around each test here (the triton backend checks it), and removed once collection is over so
that it does not leak into the rest of the session.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest

os.environ["TRITON_INTERPRET"] = "1"

# Twice: a module that imports a kernel from a sibling (kv_write takes rotary's) gets the interpreted
# one on the second pass whatever the order.
for _pass in range(2):
    for _name in sorted(n for n in sys.modules if n.startswith("tokenspeed_kernels.")):
        importlib.reload(sys.modules[_name])


def pytest_collection_finish(session: pytest.Session) -> None:
    os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
