"""Flatten block tables into the CSR page list that flashinfer's paged kernels read.

Row b of block_tables [B, W] contributes its first indptr[b+1] - indptr[b] entries to
indices[indptr[b]:indptr[b+1]]. One program per row, so no host round trip is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128


@triton.jit
def _flatten_kernel(block_tables_ptr, indptr_ptr, indices_ptr, stride_bt, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    lo = tl.load(indptr_ptr + b)
    count = tl.load(indptr_ptr + b + 1) - lo
    for c0 in range(0, count, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < count
        ids = tl.load(block_tables_ptr + b * stride_bt + offs, mask=mask)
        tl.store(indices_ptr + lo + offs, ids, mask=mask)


def flatten_block_tables(
    block_tables: torch.Tensor, indptr: torch.Tensor, total: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """indices [total] int32 (or the first `total` entries of `out`); indptr [B+1] int32 on the device."""
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=block_tables.device)
    num_rows = block_tables.shape[0]
    if num_rows and total:
        _flatten_kernel[(num_rows,)](block_tables, indptr, out, block_tables.stride(0), CHUNK=CHUNK)
    return out


def flatten_block_tables_reference(block_tables: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    bounds = indptr.tolist()
    rows = [block_tables[b, : bounds[b + 1] - bounds[b]] for b in range(block_tables.shape[0])]
    return torch.cat(rows).to(torch.int32) if rows else block_tables.new_zeros(0)
