#!/usr/bin/env python3
"""The two ceilings measured in the same run as the benchmarks: device-to-device copy bandwidth
(bytes read + written per second, 4 GiB buffers, median of 20) and a bf16 8192^3 matmul (TFLOP/s,
random data, median of 20). Prints and writes JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from app.bench.latency import median_cuda_ms  # noqa: E402


def timed(fn, iters: int = 20) -> float:
    """Median seconds of fn() over iters runs after 3 warm-ups, timed with CUDA events."""
    for _ in range(3):
        fn()
    return median_cuda_ms(fn, iters) / 1e3


def main() -> None:
    dev = torch.device("cuda")
    src = torch.randn(1 << 30, device=dev)  # 4 GiB of float32
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / copy_s
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_s = timed(lambda: a @ b)
    result = {
        "device": torch.cuda.get_device_name(dev),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bf16_matmul_tflops": 2 * 8192**3 / mm_s / 1e12,
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
