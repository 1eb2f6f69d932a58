"""Checkpoint weights into a model's parameters, one tensor at a time.

Formats (--load-format): safetensors (one file, or shards listed by model.safetensors.index.json),
pt (pytorch_model.bin, or shards listed by pytorch_model.bin.index.json), auto (safetensors if the
directory has any, else pt), dummy (no files: every floating parameter uniform(-1e-3, 1e-3) from a
generator seeded 1234). Each checkpoint tensor is read, copied into its (possibly fused) parameter
in the model's dtype and device, and dropped before the next one, so the checkpoint is never held
in memory twice. With tensor parallelism each rank reads only its part of each tensor (the
parameter's TP slice, app/worker/layers/linear.py). FP8 layers (app.worker.quantization) fill their
parameters through their own weight loaders and are brought to their run-time form once everything is
loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from app.worker.layers import SHARD_ROWS
from app.worker.layers.linear import FROM_CHECKPOINT, SHARD_VIEW, WEIGHT_LOADER, TPSlice, tp_slice
from app.worker.layers.moe import FusedExperts
from app.worker.models.dense import DenseCausalLM
from app.worker.quantization import FP8_DTYPE, FP8_MAX, finish_loading

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
DUMMY_SEED = 1234
_SHOWN = 8  # names listed in a missing/unexpected error before "and N more"


class CheckpointError(ValueError):
    """The checkpoint does not match the model (missing, unexpected or misshapen tensors) or is absent."""


def _from_index(model_dir: Path, index_name: str) -> list[Path]:
    weight_map = json.loads((model_dir / index_name).read_text())["weight_map"]
    files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index_name} lists shard files that are missing: {', '.join(absent)}")
    return files


def checkpoint_files(model_dir: Path, load_format: str) -> tuple[str, list[Path]]:
    """(resolved format, files to read) for safetensors / pt / auto."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"--load-format {load_format!r} is not supported; choose from {', '.join(LOAD_FORMATS)}"
        )
    if load_format == "auto":
        load_format = "safetensors" if any(model_dir.glob("*.safetensors")) else "pt"
    if load_format == "safetensors":
        index, single, pattern = "model.safetensors.index.json", "model.safetensors", "*.safetensors"
    elif load_format == "pt":
        index, single, pattern = "pytorch_model.bin.index.json", "pytorch_model.bin", "*.bin"
    else:
        raise ValueError(f"--load-format {load_format} reads no files")
    if (model_dir / index).is_file():
        files = _from_index(model_dir, index)
    elif (model_dir / single).is_file():
        files = [model_dir / single]
    else:
        files = sorted(model_dir.glob(pattern)) or (
            sorted(model_dir.glob("*.pt")) if load_format == "pt" else []
        )
    if not files:
        raise CheckpointError(f"no {load_format} weights found in {model_dir}")
    return load_format, files


# A checkpoint tensor not read yet: called with this rank's part (None: the whole tensor), it reads just
# that (safetensors reads only the slice's bytes; pt is mmap'd, so narrowing pages in only the slice).
TensorReader = Callable[[TPSlice | None], torch.Tensor]


def take(tensor: torch.Tensor, part: TPSlice | None) -> torch.Tensor:
    return tensor if part is None else part.take(tensor)


def _read_safetensors(f: Any, name: str, part: TPSlice | None) -> torch.Tensor:
    if part is not None:
        piece = f.get_slice(name)
        if part.splits(piece.get_shape()):
            return piece[(slice(None),) * part.dim + (slice(part.start, part.start + part.length),)]
    return f.get_tensor(name)


def iterate_tensors(load_format: str, files: list[Path], progress: Callable[[float], None] | None = None
                    ) -> Iterator[tuple[str, TensorReader]]:
    """(name, reader) for every tensor of every file; a reader must be called before the next item.
    `progress` hears the fraction of the files' bytes done after each tensor (a file's bytes counted
    evenly over its tensors)."""
    sizes = [path.stat().st_size for path in files]
    total, before = max(sum(sizes), 1), 0
    for path, size in zip(files, sizes, strict=True):
        if load_format == "safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                for i, name in enumerate(names):
                    yield name, partial(_read_safetensors, f, name)
                    if progress is not None:
                        progress((before + size * (i + 1) / len(names)) / total)
        else:
            # mmap: tensors are paged in as they are copied, not read up front.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            names = list(state)
            for i, name in enumerate(names):
                yield name, partial(take, state.pop(name))
                if progress is not None:
                    progress((before + size * (i + 1) / len(names)) / total)
        before += size


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def load_tensors(model: DenseCausalLM, tensors: Iterator[tuple[str, torch.Tensor | TensorReader]]) -> int:
    """Copy checkpoint tensors (or, with tensor parallelism, this rank's parts of them) into the model;
    every parameter must be filled exactly once. Returns the number of tensors loaded."""
    params = dict(model.named_parameters())
    expected = {
        name
        for p, param in params.items()
        if getattr(param, FROM_CHECKPOINT, True)
        for name, _ in model.checkpoint_names(p)
    }
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if model.ignores_checkpoint_tensor(name):
            continue
        param_name, shard = model.checkpoint_target(name)
        if name not in expected or param_name not in params:
            unexpected.append(name)
            continue
        if name in seen:
            raise CheckpointError(f"checkpoint tensor {name} appears twice")
        param = params[param_name]
        part = tp_slice(param, shard)
        try:
            piece = tensor(part) if callable(tensor) else take(tensor, part)
        except ValueError as exc:  # the tensor's size along the split dimension is wrong
            raise CheckpointError(f"checkpoint tensor {name} {exc}") from exc
        _copy_into(param, piece, name, shard, part)
        seen.add(name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {_listed(sorted(unexpected))}")
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {_listed(missing)}")
    return len(seen)


def shard_view(param: nn.Parameter, shard: str | None, part: TPSlice | None, tensor: torch.Tensor) -> torch.Tensor:
    """Where a checkpoint tensor (or this rank's part of it) goes in its parameter: the shard's rows, and
    within them the part's leading elements (the rest is the last vocab shard's zero padding)."""
    target = param.data
    if hasattr(param, SHARD_VIEW):
        target = getattr(param, SHARD_VIEW)(shard)
    elif shard is not None:
        first, rows = getattr(param, SHARD_ROWS)[shard]
        target = target.narrow(0, first, rows)
    if part is not None and tensor.dim() > part.dim and tensor.shape[part.dim] == part.length < target.shape[part.dim]:
        target = target.narrow(part.dim, 0, part.length)
    return target


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, name: str, shard: str | None,
               part: TPSlice | None = None) -> None:
    if not tensor.is_floating_point():
        raise CheckpointError(f"checkpoint tensor {name} has dtype {tensor.dtype}; only float weights load")
    loader = getattr(param, WEIGHT_LOADER, None)
    if loader is not None:
        try:
            loader(tensor, shard)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint tensor {name} {exc}") from exc
        return
    if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
        raise CheckpointError(
            f"checkpoint tensor {name} is FP8 but the model holds it in {param.dtype}: its quantization "
            "is not supported (only decoder linears are quantized)"
        )
    target = shard_view(param, shard, part, tensor)
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)


def init_dummy(model: nn.Module) -> None:
    """Every floating parameter uniform(-1e-3, 1e-3) from a generator seeded DUMMY_SEED (per device); FP8
    codes not drawn by a quantization method (MoE experts) uniform over e4m3's range."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, param in model.named_parameters():
            if not param.is_floating_point() or hasattr(param, FROM_CHECKPOINT):
                continue  # a quantized layer's parameters: finish_loading draws them
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(DUMMY_SEED)
            if param.dtype == FP8_DTYPE:  # codes over e4m3's range; their layer's scales make them dummy-sized
                for part in param.data:  # a float draw of one slice at a time (an expert's)
                    part.copy_(torch.empty(part.shape, device=param.device).uniform_(-FP8_MAX, FP8_MAX, generator=gen))
                continue
            param.uniform_(-1e-3, 1e-3, generator=gen)


def load_weights(model: DenseCausalLM, model_dir: Path, load_format: str,
                 progress: Callable[[str], None] | None = None) -> str:
    """Fill the model from model_dir per --load-format; returns the format actually used. `progress`
    hears how far the read is ("42% of 16.1 GB"), for the start-up log."""
    if load_format == "dummy":
        init_dummy(model)
        finish_loading(model, dummy_seed=DUMMY_SEED)
        _finish_experts(model, dummy=True)
        return "dummy"
    resolved, files = checkpoint_files(model_dir, load_format)
    gb = sum(path.stat().st_size for path in files) / 1e9
    report = None if progress is None else (lambda done: progress(f"{done:.0%} of {gb:.1f} GB"))
    load_tensors(model, iterate_tensors(resolved, files, report))
    finish_loading(model)
    _finish_experts(model, dummy=False)
    return resolved


def _finish_experts(model: nn.Module, dummy: bool) -> None:
    """MoE experts from a block-scaled FP8 checkpoint are requantized per channel once all are loaded."""
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.finish_loading(dummy)
