#!/usr/bin/env python3
"""What the offline decode step's quantizing kernels compile to for the H200 (sm_90), without a GPU: for
each, its registers a thread and spill bytes (Triton's ptxas -v) and its SASS instructions by opcode
(cuobjdump -sass), at the 8B model's shapes and 512 rows. Compiled through tests/support/compile_kernels'
stand-in driver, in a process without TRITON_INTERPRET.

  env -u TRITON_INTERPRET python scripts/kernel_code.py [silu quantize_rows add_rms_norm]
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from tokenspeed_kernels import activation, fp8_quant, rmsnorm  # noqa: E402

from tests.support.compile_kernels import compile_for  # noqa: E402

ROWS, HIDDEN, INTER = 512, 4096, 14336
NVIDIA_BIN = Path(triton.__file__).parent / "backends/nvidia/bin"


def cases() -> dict[str, Callable[[], object]]:
    x = torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16)
    gate_up = torch.zeros(ROWS, 2 * INTER, dtype=torch.bfloat16)
    weight = torch.zeros(HIDDEN, dtype=torch.bfloat16)
    return {
        "silu": lambda: activation.silu_and_mul_fp8(gate_up),
        "quantize_rows": lambda: fp8_quant.quantize_rows(x),
        "add_rms_norm": lambda: rmsnorm.add_rms_norm_fp8(x, x.clone(), weight, 1e-6),
    }


def describe(ptx: str) -> str:
    """Registers, spill bytes and the SASS opcodes (most frequent first) of one kernel's PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(ptx)
        cubin = str(Path(tmp, "k.cubin"))
        report = subprocess.run([NVIDIA_BIN / "ptxas", "-v", "-arch=sm_90a", Path(tmp, "k.ptx"), "-o", cubin],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
        sass = subprocess.run([NVIDIA_BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    registers = re.search(r"Used (\d+) registers", report).group(1)
    spills = re.search(r"(\d+) bytes spill stores", report)
    opcodes = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    top = ", ".join(f"{op} {count}" for op, count in opcodes.most_common(12))
    return (f"{registers} registers, {spills.group(1) if spills else '?'} spill bytes, "
            f"{sum(opcodes.values())} instructions: {top}")  # fmt: skip


def main() -> None:
    known = cases()
    for name in sys.argv[1:] or known:
        for kernel in compile_for(90, known[name]):
            print(f"{name} ({kernel.name}, {kernel.metadata.num_warps} warps): {describe(kernel.asm['ptx'])}")


if __name__ == "__main__":
    main()
