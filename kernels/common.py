"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL_AVAILABLE = True
except ImportError:  # an older Triton: the kernels compile without the PDL branch (set_pdl refuses)

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

    PDL_AVAILABLE = False

# Under Triton's interpreter (the CPU tests): read when a module is loaded, as Triton reads it.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
FP8_DTYPE = torch.float8_e4m3fn  # the FP8 KV cache's storage type (Triton's float8e4nv)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Up to this many rows a one-program-a-row kernel's latency is its program's (fewer programs than SMs):
# the norm and quantize_rows then give each program more warps (few_row_warps).
FEW_ROWS = 64


def few_row_warps(block: int) -> int:
    """Warps for a program holding a row of block elements when there are few rows: about 8 elements a
    thread (one 16-byte load of 16-bit x), 4 to 16 warps."""
    return min(16, max(4, block // 256))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands stay exact (IEEE); half types use the tensor cores' native path."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(x.stride())}")


def check_kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales dequantize an FP8 cache; any other cache reads its values as they are."""
    if cache.dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"KV scales other than 1.0 need an FP8 cache, not {cache.dtype}")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"KV scales must be positive, got {k_scale} and {v_scale}")


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """The layer's K and V caches a kernel writes: one dtype, contiguous, scales that suit it."""
    check_kv_scales(k_cache, k_scale, v_scale)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the K and V caches differ in dtype: {k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache tensors must be contiguous")


def check_rows(name: str, x: torch.Tensor) -> None:
    """x [T, heads, dim]: rows may be strided views (of a fused QKV output), heads and dims contiguous."""
    if x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        raise ValueError(f"{name} rows must hold contiguous [heads, dim], got strides {tuple(x.stride())}")


# Per device: counts with which the programs of one kernel find the last of them to finish a piece of work,
# which then does what needs all the pieces (the GEMV's split-K sums). Each kernel leaves its counts at
# zero, and the next one starts after it ends (the forward pass runs on one stream; under PDL a kernel ends
# only after waiting for the one before), so one buffer serves them all. A CUDA graph keeps the address it
# captured: a buffer outgrown stays allocated.
_arrivals: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counts, all zero between kernels."""
    buffers = _arrivals.get(device)
    if buffers is None or buffers[-1].numel() < n:
        buffers = _arrivals.setdefault(device, [])
        buffers.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def last_to_arrive(count_ptr, expected):
    """Count this program in (after all its threads' stores: the barrier, then the release) and say whether
    it is the expected-th, the last; that one's acquire orders the others' stores before its reads (which
    must go to the L2: cache_modifier=".cg") and it zeroes the count for the next kernel."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == expected - 1
    if last:
        tl.store(count_ptr, 0)
    return last


# Programmatic dependent launch (Hopper and newer): the decode-path kernels are launched so that the
# next kernel's programs are scheduled while this one's last wave runs, each waiting (griddepcontrol)
# for its predecessor's memory before touching what that one writes. Off by default here; the model
# runner turns it on for one Hopper-or-newer GPU (--enable-pdl) before its CUDA graphs are captured.
_pdl = False


def set_pdl(enabled: bool) -> None:
    if enabled and not PDL_AVAILABLE:
        raise RuntimeError(f"programmatic dependent launch needs Triton 3.4 or newer, not {triton.__version__}")
    global _pdl
    _pdl = enabled


def pdl_enabled() -> bool:
    """Whether kernels launch with programmatic dependent launch (set_pdl)."""
    return _pdl


_PDL_ON = {"USE_PDL": True, "launch_pdl": True}
_PDL_OFF = {"USE_PDL": False}


def pdl_options() -> dict[str, bool]:
    """The launch keywords (not to be modified): the kernel's USE_PDL constexpr, and Triton's launch_pdl
    when on."""
    return _PDL_ON if _pdl else _PDL_OFF


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """Under PDL, wait until the previous kernel's memory is visible, then let the next kernel's programs
    be scheduled. A kernel's first statement, or after loads of what the kernel before it does not
    write: weights and scales, the step's inputs (positions, slots, block tables). Every kernel lets the
    next one in only after its own wait, so when a kernel starts, all but the one before it have ended."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
