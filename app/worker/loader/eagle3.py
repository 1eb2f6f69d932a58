"""Loading an EAGLE-3 head (app/worker/models/eagle3.py) from its published checkpoint: the layer's
tensors go through the shared loader; `d2t` (draft id -> target id offsets) is read into the head's map;
`t2d` (its inverse, a mask over the target vocabulary) and the embedding (the target's) are skipped.
Some exports prefix the names with `model.`: both spellings load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from app.worker.loader.weights import (
    CheckpointError,
    TensorReader,
    checkpoint_files,
    init_dummy,
    iterate_tensors,
    load_tensors,
)
from app.worker.models.eagle3 import EMBEDDING_TENSOR, VOCAB_MAP_TENSORS, Eagle3Head


def load_eagle3_weights(head: Eagle3Head, model_dir: Path, load_format: str) -> str:
    """Fill the head from model_dir (--load-format as the target's); returns the format used. dummy:
    small uniform weights and the identity vocabulary map."""
    if load_format == "dummy":
        init_dummy(head)
        return "dummy"
    resolved, files = checkpoint_files(model_dir, load_format)
    maps: dict[str, torch.Tensor] = {}

    def layer_tensors() -> Iterator[tuple[str, TensorReader]]:
        for name, reader in iterate_tensors(resolved, files):
            name = name.removeprefix("model.")
            if name in VOCAB_MAP_TENSORS:
                maps[name] = reader(None)
            elif name != EMBEDDING_TENSOR:
                yield name, reader

    load_tensors(head, layer_tensors())  # type: ignore[arg-type]  # the head maps names as a dense model does
    _load_d2t(head, maps.get("d2t"))
    return resolved


def _load_d2t(head: Eagle3Head, d2t: torch.Tensor | None) -> None:
    if d2t is None:
        if head.draft_vocab_size != head.vocab_size:
            raise CheckpointError(
                f"the EAGLE-3 head's draft vocabulary ({head.draft_vocab_size}) is smaller than the target's "
                f"({head.vocab_size}) but its checkpoint has no d2t map"
            )
        return
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (head.draft_vocab_size,):
        raise CheckpointError(
            f"the EAGLE-3 head's d2t must be integers of shape ({head.draft_vocab_size},), "
            f"got {d2t.dtype} {tuple(d2t.shape)}"
        )
    target = d2t.to(torch.int64) + torch.arange(head.draft_vocab_size)
    if int(target.min()) < 0 or int(target.max()) >= head.vocab_size:
        raise CheckpointError(f"the EAGLE-3 head's d2t maps draft ids outside the target vocabulary [0, {head.vocab_size})")
    with torch.no_grad():
        head.d2t.copy_(d2t.to(torch.int64))
