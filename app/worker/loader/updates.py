"""Weight updates on a live model (the RL control plane's worker side).

Every update is all-or-nothing: each incoming tensor's name, shape and dtype is checked against the
model before the first parameter changes, so a refused update leaves the served weights as they
were. A disk reload checks the whole checkpoint's metadata (safetensors headers, or the mmap'd
state dict for pt) first, then streams the tensors into the parameters one at a time (no staging
copy of the model). Tensor and broadcast updates hold their tensors already; they may update any
subset of the checkpoint's tensors. Names are the checkpoint's (Hugging Face) names: q_proj/k_proj/
v_proj and gate_proj/up_proj land in their slices of the fused parameters.

update_weights_from_tensor payload: each element of `serialized_named_tensors` is the bytes of
`safetensors.torch.save({name: tensor, ...})` (base64 in the HTTP body), one element per worker rank.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from app.config.settings import Settings
from app.protocol import (
    ControlOp,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)
from app.worker.layers import SHARD_ROWS
from app.worker.layers.cpu_weights import plain_weights
from app.worker.layers.linear import SHARD_VIEW, TPSlice, tp_slice
from app.worker.loader.hf_config import load_hf_config
from app.worker.loader.source import resolve_model_path
from app.worker.loader.update_group import UpdateGroup, open_update_group
from app.worker.loader.weights import checkpoint_files, iterate_tensors, shard_view
from app.worker.models.dense import DenseCausalLM

log = logging.getLogger(__name__)

# Config fields a reloaded checkpoint must share with the served model (shapes alone miss some).
_SAME_CONFIG = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                "rope_theta", "rope_parameters", "rope_scaling")
# Weight dtypes an update may carry (converted to the model's dtype); FP8 would need its scales.
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_SHOWN = 8
# A Hub repo id ("org/name" or "name"): fetched into the download cache, never read from elsewhere.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class UpdateError(ValueError):
    """The update was refused; the served weights are unchanged."""


@dataclass(frozen=True)
class _Target:
    name: str  # checkpoint name
    param: torch.nn.Parameter
    shard: str | None

    @property
    def part(self) -> TPSlice | None:
        """This rank's part of the checkpoint tensor (tensor parallelism), None for all of it."""
        return tp_slice(self.param, self.shard)

    def view(self) -> torch.Tensor:
        """The rows of the parameter this checkpoint tensor (this rank's part of it) fills."""
        data = self.param.data
        if hasattr(self.param, SHARD_VIEW):
            return getattr(self.param, SHARD_VIEW)(self.shard)
        if self.shard is None:
            return data
        first, rows = getattr(self.param, SHARD_ROWS)[self.shard]
        return data.narrow(0, first, rows)

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor that fills this target."""
        shape = list(self.view().shape)
        if self.part is not None:
            shape[self.part.dim] = self.part.full
        return tuple(shape)

    def fill(self, tensor: torch.Tensor) -> None:
        """Copy the checkpoint tensor (or, already cut, this rank's part of it) in."""
        part = self.part
        if part is not None and tensor.shape[part.dim] == part.full and part.full != part.length:
            tensor = part.take(tensor)
        shard_view(self.param, self.shard, part, tensor).copy_(tensor)


class TargetMap:
    """Checkpoint tensor name -> the parameter (slice) it fills, for one model."""

    def __init__(self, model: DenseCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.expected = {name for p in self.params for name, _ in model.checkpoint_names(p)}

    def check(self, entries: Iterable[tuple[str, tuple[int, ...], str]], complete: bool) -> list[_Target]:
        """Targets for (name, shape, dtype name) entries; raises UpdateError listing every problem.
        complete: every parameter must be covered (a whole checkpoint)."""
        targets: list[_Target] = []
        problems: list[str] = []
        seen: set[str] = set()
        for name, shape, dtype in entries:
            if self.model.ignores_checkpoint_tensor(name):
                continue
            param_name, shard = self.model.checkpoint_target(name)
            if name not in self.expected or param_name not in self.params:
                problems.append(f"unknown tensor {name}")
                continue
            if name in seen:
                problems.append(f"tensor {name} appears twice")
                continue
            seen.add(name)
            target = _Target(name, self.params[param_name], shard)
            want = target.checkpoint_shape()
            if tuple(shape) != want:
                problems.append(f"tensor {name} has shape {list(shape)}, the model expects {list(want)}")
            elif dtype not in FLOAT_DTYPES:
                problems.append(f"tensor {name} has dtype {dtype}; updates take {', '.join(FLOAT_DTYPES)}")
            else:
                targets.append(target)
        if complete:
            problems += [f"tensor {name} is missing" for name in sorted(self.expected - seen)]
        if problems:
            shown = "; ".join(problems[:_SHOWN])
            more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise UpdateError(f"weights not updated: {shown}{more}")
        return targets


def apply(targets: list[_Target], tensors: Iterable[torch.Tensor]) -> int:
    """Copy checked tensors into their parameters (dtype and device converted); returns the count."""
    count = 0
    with torch.no_grad():
        for target, tensor in zip(targets, tensors, strict=True):
            target.fill(tensor)
            count += 1
    return count


# ---------------------------------------------------------------- from disk


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header_entries(load_format: str, files: list[Path]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype name) of every tensor, from the files' metadata (no tensor data is read)."""
    for path in files:
        if load_format == "safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = piece.get_dtype()
                    yield name, tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                yield name, tuple(tensor.shape), _dtype_name(tensor.dtype)


def _check_config(served: Any, model_dir: Path, settings: Settings) -> None:
    new = load_hf_config(model_dir, settings.hf_overrides, settings.trust_remote_code).to_dict()
    old = served.to_dict()
    differ = [key for key in _SAME_CONFIG if old.get(key) != new.get(key)]
    if differ:
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ)
        raise UpdateError(f"weights not updated: {model_dir} is a different model ({details}); "
                          "serving another architecture needs a new appliance")


def allowed_roots(served_dir: Path, settings: Settings) -> list[Path]:
    """Where update_weights_from_disk may read: the served model's directory, the download cache and
    --weight-update-roots, with symbolic links resolved."""
    from huggingface_hub.constants import HF_HUB_CACHE

    roots = [served_dir, settings.download_dir or HF_HUB_CACHE, *settings.weight_update_roots]
    return [Path(os.path.realpath(Path(root).expanduser())) for root in roots]


def _below(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _update_dir(model_path: str, fmt: str, settings: Settings, roots: list[Path]) -> Path:
    """The checkpoint directory an update reads, refused (UpdateError) unless it lies below a root. The
    check comes before any file is read, and its message is the same whether the path exists or not:
    a caller learns nothing of the file system outside the roots."""
    refused = UpdateError(f"weights not updated: model_path {model_path!r} is not below an allowed root (the served "
                          "model's directory, the download cache, or a --weight-update-roots directory)")
    local = Path(os.path.realpath(Path(model_path).expanduser()))
    if not _below(local, roots) and not _HUB_ID.fullmatch(model_path):
        raise refused
    model_dir = resolve_model_path(model_path, fmt, None, settings.download_dir, settings.trust_remote_code)
    if not _below(Path(os.path.realpath(model_dir)), roots):  # a Hub id that named a local directory
        raise refused
    return model_dir


def update_from_disk(model: DenseCausalLM, served_config: Any, settings: Settings, model_path: str,
                     load_format: str | None, roots: list[Path]) -> str:
    """Reload every weight from a checkpoint directory (or Hub id) of the same model, below `roots`."""
    fmt = load_format or "auto"
    if fmt == "dummy":
        raise UpdateError("update_weights_from_disk needs a checkpoint: load_format 'dummy' reads no files")
    try:
        model_dir = _update_dir(model_path, fmt, settings, roots)
        _check_config(served_config, model_dir, settings)
        resolved, files = checkpoint_files(model_dir, fmt)
        targets = TargetMap(model).check(_header_entries(resolved, files), complete=True)
    except UpdateError:
        raise
    except (ValueError, OSError) as exc:  # no such model, no config, no or unreadable weights
        raise UpdateError(f"weights not updated: {exc}") from exc
    by_name = {t.name: t for t in targets}
    count = 0
    with torch.no_grad():  # one checkpoint tensor in memory at a time
        for name, read in iterate_tensors(resolved, files):
            target = by_name.get(name)
            if target is not None:
                target.fill(read(target.part))
                count += 1
    return f"Loaded {count} tensors from {model_dir} ({resolved})."


# ---------------------------------------------------------------- from tensors and broadcasts


def decode_named_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(payload)
    except Exception as exc:  # safetensors raises its own error types for malformed bytes
        raise UpdateError(f"weights not updated: the payload is not safetensors data ({exc})") from exc


def update_from_tensors(model: DenseCausalLM, named: list[tuple[str, torch.Tensor]]) -> str:
    if not named:
        raise UpdateError("weights not updated: no tensors given")
    entries = [(name, tuple(t.shape), _dtype_name(t.dtype)) for name, t in named]
    targets = TargetMap(model).check(entries, complete=False)
    by_name = dict(named)
    count = apply(targets, (by_name[t.name] for t in targets))
    return f"Updated {count} tensors."


def parse_dtype(name: str) -> torch.dtype:
    label = str(name).removeprefix("torch.")
    if label not in FLOAT_DTYPES:
        raise UpdateError(f"weights not updated: dtype {name!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return getattr(torch, label)


class UpdateGroups:
    """The worker's open trainer groups, by name."""

    def __init__(self, worker_rank: int) -> None:
        self.worker_rank = worker_rank
        self.groups: dict[str, UpdateGroup] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str) -> str:
        if group_name in self.groups:
            raise UpdateError(f"weight update group {group_name!r} already exists; destroy it first")
        rank = rank_offset + self.worker_rank
        try:
            self.groups[group_name] = open_update_group(master_address, master_port, rank, world_size,
                                                        group_name, backend)
        except (ValueError, RuntimeError) as exc:
            raise UpdateError(f"could not join weight update group {group_name!r}: {exc}") from exc
        return f"Joined weight update group {group_name!r} as rank {rank} of {world_size} ({backend})."

    def destroy(self, group_name: str) -> str:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise UpdateError(f"no weight update group {group_name!r}")
        group.destroy()
        return f"Destroyed weight update group {group_name!r}."

    def receive(self, model: DenseCausalLM, group_name: str, names: list[str], dtypes: list[str],
                shapes: list[list[int]]) -> str:
        """Receive every announced tensor from the trainer (rank 0), then check and apply them all."""
        group = self.groups.get(group_name)
        if group is None:
            raise UpdateError(f"no weight update group {group_name!r}: call /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise UpdateError("names, dtypes and shapes must have the same length")
        layouts = [(parse_dtype(dtype), [int(d) for d in shape]) for dtype, shape in zip(dtypes, shapes, strict=True)]
        if any(d < 0 for _, shape in layouts for d in shape):
            raise UpdateError("weights not updated: a shape has a negative dimension")
        received: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():  # receive everything first: the trainer's broadcasts must all complete
            for name, (dtype, shape) in zip(names, layouts, strict=True):
                tensor = torch.empty(shape, dtype=dtype, device=group.device)
                group.broadcast(tensor)
                received.append((name, tensor))
        return update_from_tensors(model, received)


# ---------------------------------------------------------------- the worker's entry point


class WeightControl:
    """Runs the scheduler's weight operations on a ModelRunner; returns the reply message or raises."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.groups = UpdateGroups(runner.tp.rank)

    def handle(self, op: ControlOp) -> str:
        """Run one weight operation (weight_version and flush_cache are the scheduler's, not read here)."""
        r = self.runner
        if r.device.type == "cuda":
            torch.cuda.set_device(r.device)  # this may run on a helper thread
        if isinstance(op, InitWeightsUpdateGroup):
            return self.groups.init(op.master_address, op.master_port, op.rank_offset, op.world_size,
                                    op.group_name, op.backend)
        if isinstance(op, DestroyWeightsUpdateGroup):
            return self.groups.destroy(op.group_name)
        if getattr(r, "quant_scheme", None) is not None:
            raise UpdateError("weights not updated: updating a quantized model's weights is not supported yet")
        if not isinstance(op, UpdateWeightsFromDisk | UpdateWeightsFromDistributed | UpdateWeightsFromTensor):
            raise UpdateError(f"unknown weight operation {type(op).__name__}")
        with plain_weights(r.model):  # CPU weights packed for oneDNN are written unpacked, then packed again
            if isinstance(op, UpdateWeightsFromDisk):
                roots = allowed_roots(r.model_dir, r.settings)
                return update_from_disk(r.model, r.config, r.settings, op.model_path, op.load_format, roots)
            if isinstance(op, UpdateWeightsFromDistributed):
                return self.groups.receive(r.model, op.group_name, op.names, op.dtypes, op.shapes)
            return update_from_tensors(r.model, list(decode_named_tensors(op.tensors).items()))
