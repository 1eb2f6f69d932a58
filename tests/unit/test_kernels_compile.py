"""Every Triton kernel compiles for the H200 (sm_90) and the A100 (sm_80) with the appliance's dtypes and
GEMV configurations, without a GPU (tests/support/compile_kernels.py): the interpreter-run kernel tests
cannot see what only the GPU compiler rejects."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90_and_sm80() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests/support/compile_kernels.py")],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = set(done.stdout.split("compiled:")[1].split())
    defined = {
        name
        for path in (REPO / "kernels").glob("*.py")
        for name in re.findall(r"^@triton\.jit\s+def (_\w+_kernel)\(", path.read_text(), re.M)
    }
    assert defined and defined == compiled, f"not compiled: {sorted(defined - compiled)}"
