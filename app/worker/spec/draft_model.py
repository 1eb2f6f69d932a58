"""The standalone draft model (`--speculative-algorithm STANDALONE --speculative-draft-model-path M`): a
smaller dense model of the same tokenizer drafts greedily, k tokens a step, from its own paged KV cache
(app/worker/spec/drafter.py: same block ids as the target's).

Its cache holds the committed tokens at their positions, as the target's does. After each target step
it catches up: verified drafts it wrote itself stay (same tokens, same positions), so it feeds only what
it lacks: the chunk's tokens after a prefill chunk, the token the target sampled after a verify (and the
last draft, when every draft was accepted). A prefix-cache hit or a preemption's recompute is fed in
full (the draft recomputes it, in forwards of at most the step's token budget).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.config.settings import Settings
from app.model_files import draft_load_format
from app.worker.attention import AttentionMetadata, AttentionSpec
from app.worker.kv_cache import KVCacheSpec
from app.worker.loader import load_hf_config, load_weights, resolve_model_path
from app.worker.models import DenseCausalLM, model_class_for
from app.worker.quantization import Fp8LinearMethod, resolve_quantization
from app.worker.spec.drafter import ChainDrafter, Feed
from app.worker.spec.proposer import TargetStep

# --speculative-draft-model-quantization values this build runs (others are refused naming the flag).


class DraftModelProposer(ChainDrafter):
    def __init__(self, model: DenseCausalLM, device: torch.device, max_slots: int, max_tokens: int) -> None:
        super().__init__(device, max_slots, model.dims.hidden, model.dtype, max_tokens)
        self.model = model

    @classmethod
    def load(cls, settings: Settings, target_config: Any, device: torch.device, dtype: torch.dtype,
             max_model_len: int, max_slots: int, max_tokens: int) -> DraftModelProposer:
        """Load --speculative-draft-model-path beside the target (same dtype, its own quantization)."""
        return cls(load_draft_model(settings, target_config, device, dtype, max_model_len), device, max_slots,
                   max_tokens)

    @property
    def cache_spec_for(self) -> Callable[[torch.dtype], KVCacheSpec]:
        return self.model.kv_cache_spec

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.model.attention_spec

    @property
    def draft_vocab_size(self) -> int:
        return self.model.dims.vocab_size

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(ids, positions, meta)
        return hidden, hidden  # a draft model reads no features: the chain carries its hidden unused

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.compute_logits(hidden, out)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the same vocabulary

    def _catch_up(self, step: TargetStep) -> Feed:
        feed = Feed()
        for i, slot in enumerate(step.slots):
            seq = self.seqs.get(slot)
            if seq is None:
                continue
            seq.tokens += step.new_tokens[i]
            seq.confirm(step.start[i] + step.kept[i])
            # A chunk that did not sample: up to what the target fed; else the new token too.
            self._feed_slot(feed, slot, len(seq.tokens) if step.new_tokens[i] else step.start[i] + step.kept[i])
        return feed

    def _late_catch_up(self, slots: list[int]) -> Feed:
        feed = Feed()
        for slot in slots:
            if not self.seqs[slot].ready:
                self._feed_slot(feed, slot, len(self.seqs[slot].tokens))
        return feed

    def _feed_slot(self, feed: Feed, slot: int, end: int) -> None:
        """Feed the slot's committed tokens from its valid prefix to `end`, as far as its blocks reach (the
        sampled token's position may lie in a block the next step brings); the last committed token fed
        gives the first draft."""
        seq = self.seqs[slot]
        end = min(end, self.capacity(slot))
        if end > seq.valid:
            feed.add(slot, seq.valid, seq.tokens[seq.valid : end], end == len(seq.tokens))
            seq.valid = seq.fed = end

    def _chain_position(self, num_tokens: int, j: int) -> int:
        return num_tokens - 1 + j  # step j feeds draft j after the last committed token


def resolve_draft(settings: Settings) -> tuple[Path, Any]:
    """The draft's (or EAGLE-3 head's) directory, a Hub id read from the supervisor's copy, and its config."""
    model_dir = resolve_model_path(settings.speculative_draft_model_path, draft_load_format(settings.load_format),
                                   None, settings.download_dir, settings.trust_remote_code)
    return model_dir, load_hf_config(model_dir, None, settings.trust_remote_code)


def load_draft_model(settings: Settings, target_config: Any, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> DenseCausalLM:
    """The draft model, checked against the target: a supported dense family, the same vocabulary, a
    context at least the target's --max-model-len."""
    flag = "--speculative-draft-model-path"  # Settings checked it is set, and the quantization
    path = settings.speculative_draft_model_path
    model_dir, config = resolve_draft(settings)
    if int(config.vocab_size) != int(target_config.vocab_size):
        raise ValueError(f"{flag} {path}: its vocabulary ({config.vocab_size} tokens) differs from the target's "
                         f"({target_config.vocab_size}); a draft model must share the target's tokenizer")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and int(limit) < max_model_len:
        raise ValueError(f"{flag} {path}: its context ({limit} positions) is shorter than --max-model-len "
                         f"{max_model_len}")
    try:
        cls = model_class_for(config)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    fp8 = settings.speculative_draft_model_quantization == "fp8"
    scheme = resolve_quantization("fp8" if fp8 else None, config)
    with torch.device(device):
        model = cls(config, dtype, max_model_len, quant=Fp8LinearMethod(scheme) if scheme is not None else None)
    model.to(device)
    load_weights(model, model_dir, draft_load_format(settings.load_format))
    return model.eval()
