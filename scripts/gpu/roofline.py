#!/usr/bin/env python3
"""The two ceilings measured in the same run as the benchmarks: device-to-device copy bandwidth
(bytes read + written per second, 4 GiB buffers, median of 20) and a bf16 8192^3 matmul (TFLOP/s,
random data, median of 20). Prints and writes JSON."""

from __future__ import annotations

import json
import statistics
import sys

import torch


def timed(fn, iters: int = 20) -> float:
    """Median seconds of fn() over iters runs after 3 warm-ups, timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
