"""The CPU's run-time form of the linears' weights, set once after loading (`use_cpu_weight_layout`).

- bf16 / fp16 on a CPU that multiplies them natively (`cpu_host.native_half`): each unquantized linear's
  weight, and the LM head's, prepacked by oneDNN into its blocked layout, which its linear reads
  at 1.5-2x F.linear's speed at decode sizes (F.linear on a plain bf16 weight runs far below the
  memory bandwidth). The packed tensor replaces the parameter (same shape, same attributes), so the
  model holds one oneDNN copy; a tied LM head gets its own packed copy, as the embedding lookup needs the
  plain table (vocab x hidden more bytes).
  The MLP's gate_up linear (`wants_fp16_copy`) also keeps a copy packed by fbgemm as fp16 (`fp16`), where
  fbgemm is built in and every value of the weight is exactly an fp16 (a bf16 checkpoint's are, unless
  beyond fp16's narrower exponent range), which steps of up to FP16_MAX_ROWS rows (decodes of a few
  sequences) multiply by instead: fbgemm streams it faster there, with the same float32 accumulation
  and one rounding, and runs larger batches slower, so prefills and larger decodes keep the oneDNN
  weight. The price is memory: fbgemm pads in_features to a multiple of 512 (`fp16_copy_bytes`).
- Otherwise (float32, or no oneDNN packing in this torch build): each [out, in] weight stored as the
  transpose of a contiguous [in, out] tensor, which MKL multiplies faster (measured on an AVX2 host:
  decoder linears 1.3x at one row, 1.1x at a 128-token prefill).

A packed tensor is opaque (no views, no in-place copies), so weight updates run inside
`plain_weights`, which unpacks the packed weights (exactly: packing only reorders) and packs them again
afterwards.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from app.worker.cpu_host import native_half
from app.worker.layers.embedding import LMHead
from app.worker.layers.linear import FP16_MAX_ROWS, Linear

log = logging.getLogger(__name__)


@functools.cache
def packing_available() -> bool:
    """Whether this torch build packs linear weights for oneDNN and runs its linear on them."""
    try:
        weight = torch.ones(8, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 8), 16.0, dtype=torch.bfloat16)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@functools.cache
def fp16_copies_available() -> bool:
    """Whether this torch build has fbgemm's fp16-weight linear (x86 builds)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 16), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 16), packed)
        return bool(torch.equal(out, torch.full((2, 8), 16.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def wants_fp16_copy(name: str) -> bool:
    """Whether the linear of this qualified name gets an fp16 copy: the MLP's gate_up, the largest of a
    decoder layer's weights and most of what copies gain (SmolLM2, batch 1: 10.7 -> 6.6 ms a step). The
    other linears and the LM head gain as much per byte, but the appliance's RSS goal (1.5 GB for all
    processes, docs/performance.md, issue 36) leaves no room: with down's copies too, 32 streams took
    1,462 MiB (1.53 GB), and copies of every weight 461 MiB more (fbgemm pads SmolLM2's 576 input
    features to 1024)."""
    return f".{name}".endswith(".mlp.gate_up_proj")


def fp16_copy_bytes(weight: torch.Tensor) -> int:
    """The bytes of fbgemm's fp16 copy of an [out, in] weight (in_features padded to 512)."""
    out_features, in_features = weight.shape
    return 2 * out_features * -(-in_features // 512) * 512


def fp16_copy(weight: torch.Tensor) -> torch.ScriptObject | None:
    """fbgemm's fp16 copy of a plain [out, in] half weight, or None where some value is not exactly an
    fp16 (a bf16 beyond fp16's range or below its normal one) or fbgemm is missing."""
    if not fp16_copies_available():
        return None
    w = weight.detach()
    if not torch.equal(w.to(torch.float16).to(w.dtype), w):
        return None
    return torch.ops.quantized.linear_prepack_fp16(w.float(), None)


def _trim_heap() -> None:
    """Give glibc's free heap pages back to the system after making fp16 copies: their float32
    temporaries, freed between the packed weights, otherwise stay resident (about 30 MiB for SmolLM2;
    without copies there is nothing to give back that the next steps would not reuse)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed for oneDNN on this CPU."""
    return dtype in (torch.bfloat16, torch.float16) and native_half(dtype) and packing_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _replace(module: nn.Module, data: torch.Tensor) -> None:
    """module.weight becomes a new Parameter over `data` with the old one's attributes (the loader's shard
    rows and TP slices). A packed tensor cannot be a Parameter's .data, hence a new Parameter; the old
    storage is freed with the old Parameter."""
    old = module.weight
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    module.weight = new


def _cpu_linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quant is None and module.weight.device.type == "cpu":
            yield name, module


def _cpu_heads(model: nn.Module) -> Iterator[LMHead]:
    for module in model.modules():
        if isinstance(module, LMHead) and module.weight.device.type == "cpu":
            yield module


def transpose_layout(module: Linear) -> None:
    """The plain run-time form: the [out, in] weight as the transpose of a contiguous [in, out]."""
    module.weight.data = module.weight.data.t().contiguous().t()


def _pack_weight(module: Linear | LMHead, with_fp16: bool = False) -> None:
    """Pack the module's plain weight for oneDNN: in place of it, or beside it for a tied head; and
    make a linear's fp16 copy where asked and possible."""
    if isinstance(module, Linear):
        module.fp16 = fp16_copy(module.weight) if with_fp16 else None
    if isinstance(module, LMHead) and module.tied:
        module.packed = pack(module.weight)
    else:
        _replace(module, pack(module.weight))


def use_cpu_weight_layout(model: nn.Module) -> int:
    """Bring the model's CPU linears (and LM head) to their run-time form; returns the layers changed."""
    changed, packed_copy, fp16_bytes = 0, 0, 0
    with torch.no_grad():
        for name, module in _cpu_linears(model):
            if module.weight.is_mkldnn:
                continue
            if packs(module.weight.dtype):
                plain = module.weight
                _pack_weight(module, wants_fp16_copy(name))
                fp16_bytes += fp16_copy_bytes(plain) if module.fp16 is not None else 0
            else:
                transpose_layout(module)
            changed += 1
        for head in _cpu_heads(model):
            if not packs(head.weight.dtype) or head.weight.is_mkldnn or head.packed is not None:
                continue
            _pack_weight(head)
            if head.tied:
                packed_copy += head.weight.numel() * head.weight.element_size()
            changed += 1
    if packed_copy:
        log.info("the tied LM head multiplies by a oneDNN-packed copy of the embedding: +%.0f MiB",
                 packed_copy / 2**20)
    if fp16_bytes:
        _trim_heap()
        log.info("steps of up to %d rows multiply by fbgemm's fp16 copies of the MLP's gate_up: +%.0f MiB",
                 FP16_MAX_ROWS, fp16_bytes / 2**20)
    return changed


@contextmanager
def plain_weights(model: nn.Module) -> Iterator[None]:
    """Plain (strided) weights inside, for updates that write into them; packed again on the way out,
    whether the update succeeded or not."""
    unpacked: list[tuple[nn.Module, bool]] = []  # and whether it had an fp16 copy, made again from the update
    with torch.no_grad():
        for _, module in _cpu_linears(model):
            if module.weight.is_mkldnn:
                unpacked.append((module, module.fp16 is not None))
                module.fp16 = None
                _replace(module, module.weight.to_dense())
        for head in _cpu_heads(model):
            if head.packed is not None:
                head.packed = None
                unpacked.append((head, False))
            elif head.weight.is_mkldnn:
                _replace(head, head.weight.to_dense())
                unpacked.append((head, False))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, with_fp16 in unpacked:
                _pack_weight(module, with_fp16)
        if any(with_fp16 for _, with_fp16 in unpacked):
            _trim_heap()
