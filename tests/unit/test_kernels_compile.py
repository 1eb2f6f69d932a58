"""Every Triton kernel compiles for the H200 (sm_90) and the A100 (sm_80) with the appliance's dtypes and
GEMV configurations, without a GPU (tests/support/compile_kernels.py): the interpreter-run kernel tests
cannot see what only the GPU compiler rejects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.compile_kernels import check_in_compiler_process

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # compiles every kernel twice
def test_every_kernel_compiles_for_sm90_and_sm80() -> None:
    output = check_in_compiler_process("tests.support.compile_kernels:main", timeout=600)
    compiled = set(output.split("compiled:")[1].split())
    defined = {
        name
        for path in (REPO / "kernels").glob("*.py")
        for name in re.findall(r"^@triton\.jit(?:\(.*\))?\s+def (_\w+_kernel)\(", path.read_text(), re.M)
    }
    assert defined and defined == compiled, f"not compiled: {sorted(defined - compiled)}"
