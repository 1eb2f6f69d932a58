"""EAGLE-3 (`--speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD`): the head of
app/worker/models/eagle3.py drafts greedily from the target's captured hidden states, k tokens a step,
from its own one-layer paged KV cache (app/worker/spec/drafter.py: same block ids as the target's).

Head position p holds token p + 1 with the target's feature of position p. After each target step the
head is run over the positions the target kept, with their features (`TargetStep.aux_hidden`), which
also rewrites the positions the chain wrote with its own features the step before (SGLang's "draft
extend after decode"); the last one gives the first draft. The chain's later steps read the head's own
pre-norm output. Positions the target did not compute (a prefix-cache hit) keep what the head wrote
there before: drafts only, never outputs, depend on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.config.settings import Settings
from app.model_files import draft_load_format
from app.worker.attention import AttentionMetadata, AttentionSpec
from app.worker.kv_cache import KVCacheSpec
from app.worker.loader.eagle3 import load_eagle3_weights
from app.worker.models.dense import DenseCausalLM
from app.worker.models.eagle3 import Eagle3Head, capture_indices
from app.worker.spec.draft_model import resolve_draft
from app.worker.spec.drafter import ChainDrafter, Feed
from app.worker.spec.proposer import TargetStep


class Eagle3Proposer(ChainDrafter):
    def __init__(self, head: Eagle3Head, capture: tuple[int, ...], device: torch.device, max_slots: int,
                 max_tokens: int) -> None:
        super().__init__(device, max_slots, head.dims.hidden, head.dtype, max_tokens)
        self.head = head
        # The residual stream entering these target layers (app.worker.models.dense.HiddenCapture's
        # indices): the runner passes them, concatenated, as TargetStep.aux_hidden.
        self.capture_layers = capture

    @classmethod
    def load(cls, settings: Settings, target: DenseCausalLM, device: torch.device, dtype: torch.dtype,
             max_model_len: int, max_slots: int, max_tokens: int) -> Eagle3Proposer:
        path = settings.speculative_draft_model_path  # Settings checked it is set, and unquantized
        capture = capture_indices(settings.eagle3_layers_to_capture, target.dims.num_layers)
        model_dir, config = resolve_draft(settings)
        try:
            with torch.device(device):
                head = Eagle3Head(config, dtype, max_model_len, target.model.embed_tokens)
        except ValueError as exc:
            raise ValueError(f"--speculative-draft-model-path {path}: {exc}") from None
        if head.target_hidden != target.dims.hidden:
            raise ValueError(f"--speculative-draft-model-path {path}: the head reads target features of width "
                             f"{head.target_hidden}, the target's hidden size is {target.dims.hidden}")
        head.to(device)
        load_eagle3_weights(head, model_dir, draft_load_format(settings.load_format))
        return cls(head.eval(), capture, device, max_slots, max_tokens)

    @property
    def cache_spec_for(self) -> Callable[[torch.dtype], KVCacheSpec]:
        return self.head.kv_cache_spec

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.head.attention_spec

    @property
    def draft_vocab_size(self) -> int:
        return self.head.draft_vocab_size

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        assert feature is not None, "the head reads a feature at every position"
        return self.head(ids, positions, feature, meta)

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.head.lm_head(hidden, out)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)

    def _chain_feature(self, feature: torch.Tensor) -> torch.Tensor:
        """The target's captured states through the head's fc, as its forward would apply it."""
        return self.head.fc(feature) if feature.shape[-1] == 3 * self.head.target_hidden else feature

    def _catch_up(self, step: TargetStep) -> Feed:
        if step.aux_hidden is None:
            raise ValueError("the EAGLE-3 head needs the target's captured hidden states (TargetStep.aux_hidden)")
        feed = Feed()
        row = 0
        for i, slot in enumerate(step.slots):
            first, kept = row, step.kept[i]
            row += len(step.fed[i])
            seq = self.seqs.get(slot)
            if seq is None:
                continue
            seq.tokens += step.new_tokens[i]
            start = step.start[i]
            if kept < 1 or start + kept >= len(seq.tokens):  # no next token known for the last position
                continue
            tokens = seq.tokens[start + 1 : start + kept + 1]
            feed.add(slot, start, tokens, bool(step.new_tokens[i]), step.aux_hidden[first : first + kept])
            seq.valid = seq.fed = start + kept
        return feed

    def _chain_position(self, num_tokens: int, j: int) -> int:
        return num_tokens - 2 + j  # position p holds token p + 1: draft j is token num_tokens - 1 + j
