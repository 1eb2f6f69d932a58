"""Triton kernels run on the CPU here, through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before any
tokenspeed_kernels module is imported; modules imported earlier in the session are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in sorted(n for n in sys.modules if n.startswith("tokenspeed_kernels.")):
    importlib.reload(sys.modules[_name])
