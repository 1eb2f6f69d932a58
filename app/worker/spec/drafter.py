"""What the two model drafts share (a standalone draft model, an EAGLE-3 head): their own paged KV
cache, and a greedy chain of k drafts per sequence.

The draft's cache is indexed by the SAME block ids and block tables as the target's: a draft position
lives in the block the target's position lives in, so the scheduler's allocation (lookahead blocks
included), prefix sharing and frees cover both, and the pool's size counts both models' bytes per token
(`kv_bytes_per_token`). The runner builds a drafter before it sizes the pool and attaches it to the
pool's blocks and its slots' block tables afterwards:

    drafter = load_model_drafter(settings, target, ...)                 # weights (model_drafts.py)
    bytes_per_token = target_bytes + drafter.kv_bytes_per_token(dtype)   # sizing
    drafter.attach(num_blocks + 1, block_size, slots.block_tables, slots.num_blocks, dtype, backend)

Each step, observe() runs the draft over what the target just kept (a prefill chunk, or the verified
positions), so that its cache catches up, and for a sequence that sampled it keeps the draft's first
token for it (`first`). propose() then runs up to k - 1 one-token steps from there, feeding each draft
back (top-1 chain). Drafts are the argmax of the draft's logits, a deterministic draft (Draft.probs
None): the verifier keeps the target's distribution exactly with it. The draft writes only inside a
slot's blocks (`capacity`): a catch-up whose last position lies in a block not yet allocated (a prompt
that fills its blocks exactly) finishes in the next propose(), once the step's blocks are in the table;
a chain stops, for that slot, where the blocks the scheduler reserved for its drafts end.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from app.worker.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    build_attention_batch,
    make_attention_backend,
)
from app.worker.cuda_graphs import DecodeGraphs
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.spec.proposer import Draft, Proposer, TargetStep
from app.worker.transfer import upload


@dataclass
class DraftSlot:
    """One sequence as the drafter sees it: its committed tokens, and how far its draft cache is right."""

    tokens: list[int]
    valid: int = 0  # draft-cache positions below this hold what the committed tokens give
    fed: int = 0  # positions below this were written (valid..fed: drafts verification may refute)
    ready: bool = False  # `first` holds the draft's next token after the last committed one

    def confirm(self, upto: int) -> None:
        """Positions below `upto` are committed now: whatever the draft wrote there is right."""
        self.valid = max(self.valid, min(self.fed, upto))
        self.fed = self.valid


@dataclass
class Feed:
    """One forward of the draft: per row, its slot, its first position and its input tokens."""

    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)  # whether the row's last position gives `first`
    features: list[torch.Tensor | None] = field(default_factory=list)  # the target's, per position (EAGLE-3)

    def add(self, slot: int, start: int, tokens: list[int], sample: bool,
            features: torch.Tensor | None = None) -> None:
        self.slots.append(slot)
        self.starts.append(start)
        self.tokens.append(tokens)
        self.sample.append(sample)
        self.features.append(features)

    def feature_rows(self) -> torch.Tensor | None:
        """The rows' features as one [T, width] tensor, or None where the draft reads none."""
        present = [f for f in self.features if f is not None]
        return torch.cat(present) if present else None

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.tokens))


class ChainDrafter(Proposer):
    """The base of the model drafts: its cache, per-slot state and the chain. A subclass runs its model
    (`_hidden`, `_logits`, `_to_target`) and says what observe() feeds (`_catch_up`)."""

    drafts_on_device = True

    def __init__(self, device: torch.device, max_slots: int, hidden: int, dtype: torch.dtype,
                 max_tokens: int) -> None:
        self.device = torch.device(device)
        self.max_tokens = max(max_tokens, 1)  # the most tokens one catch-up forward feeds
        self.seqs: dict[int, DraftSlot] = {}
        self.first = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self.feature = torch.zeros(max_slots, hidden, dtype=dtype, device=self.device)
        self.cache: KVCache | None = None
        self.attention: AttentionBackend | None = None
        self.block_tables: torch.Tensor | None = None
        self.slot_blocks: list[int] = []  # the runner's blocks per slot (attach)
        self.block_size = 0
        self.graphs: DecodeGraphs | None = None  # the chain step's, once captured
        self.step_module: _ChainStep | None = None

    # ---- the model, per subclass

    @property
    @abstractmethod
    def cache_spec_for(self) -> Callable[[torch.dtype], KVCacheSpec]:
        """The draft model's KV cache spec for a cache dtype."""

    @property
    @abstractmethod
    def attention_spec(self) -> AttentionSpec: ...

    @abstractmethod
    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's forward over a planned batch: (the hidden states its LM head reads, [T, hidden];
        the next step's features [T, hidden], or the same hidden for a draft that reads none)."""

    @abstractmethod
    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[R, hidden] -> the draft's logits [R, its vocabulary] (into out, a graph's static buffer)."""

    @abstractmethod
    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids of the draft's vocabulary -> the target's."""

    @property
    @abstractmethod
    def draft_vocab_size(self) -> int: ...

    def _chain_feature(self, feature: torch.Tensor) -> torch.Tensor:
        """Catch-up features in the chain step's width (what its graph reads); the same by default."""
        return feature

    def _forward(self, ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor,
                 feature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft over a planned batch; -> (target token ids of the argmax at `rows`, [R] int64,
        the rows' features [R, hidden] for the next step)."""
        with torch.no_grad():
            hidden, feature = self._hidden(ids, meta.batch.positions, feature, meta)
            logits = self._logits(hidden.index_select(0, rows))
            return self._to_target(logits.argmax(dim=-1)), feature.index_select(0, rows)

    # ---- sizing and attaching

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        return self.cache_spec_for(kv_dtype).bytes_per_token

    def attach(self, num_blocks: int, block_size: int, block_tables: torch.Tensor, slot_blocks: list[int],
               kv_dtype: torch.dtype, backend: str) -> None:
        """The draft's cache over the pool's block ids (num_blocks: the target cache's, scratch included),
        the slots' block tables (the runner's device tensor) and how many of each row's blocks the slot
        holds (the runner's host list): both read at each forward. The draft writes only positions inside
        a slot's blocks: a table's further columns are stale or zero, and block 0 belongs to someone."""
        self.cache = KVCache(self.cache_spec_for(kv_dtype), num_blocks, block_size, self.device)
        self.attention = make_attention_backend(backend, self.cache, self.attention_spec)
        self.block_tables = block_tables
        self.slot_blocks = slot_blocks
        self.block_size = block_size

    def capacity(self, slot: int) -> int:
        """The positions the slot's blocks hold now."""
        return self.slot_blocks[slot] * self.block_size

    # ---- Proposer

    def register(self, slot: int, token_ids: list[int]) -> None:
        self.seqs[slot] = DraftSlot(list(token_ids))

    def release(self, slot: int) -> None:
        self.seqs.pop(slot, None)

    def observe(self, step: TargetStep) -> None:
        feed = self._catch_up(step)
        if feed.slots:
            self._run_feed(feed)

    def propose(self, slots: list[int], k: int) -> Draft:
        """Up to k drafts per slot: `first`, then up to k - 1 steps each feeding the last draft, while the
        position a step writes lies in the slot's blocks (the scheduler reserved those of its own draft
        count). A slot whose first draft is not ready gets length 0."""
        late = self._late_catch_up(slots)  # what the blocks of the last step could not hold
        if late.slots:
            self._run_feed(late)
        seqs = [self.seqs[s] for s in slots]
        lengths = [1 if seq.ready else 0 for seq in seqs]
        index = upload(slots, torch.int64, self.device)
        drafts = self.first.index_select(0, index).unsqueeze(1).repeat(1, k)
        feature = self.feature.index_select(0, index)
        lens = [len(seq.tokens) for seq in seqs]
        for j in range(1, k):
            rows = [i for i, (slot, n) in enumerate(zip(slots, lens, strict=True))
                    if lengths[i] == j and self._chain_position(n, j) < self.capacity(slot)]
            if not rows:
                break
            pick = upload(rows, torch.int64, self.device)
            ids, out = self._step([slots[i] for i in rows], [lens[i] for i in rows], j,
                                  drafts[:, j - 1].index_select(0, pick), feature.index_select(0, pick))
            drafts[:, j].index_copy_(0, pick, ids)
            feature = feature.index_copy(0, pick, out.to(feature.dtype))
            for i in rows:
                lengths[i] += 1
        for seq, n, m in zip(seqs, lens, lengths, strict=True):
            seq.ready = False
            if m > 1:
                seq.fed = max(seq.fed, self._chain_position(n, m - 1) + 1)
        return Draft(drafts, None, None if all(m == k for m in lengths) else lengths)

    def _late_catch_up(self, slots: list[int]) -> Feed:
        """The catch-up observe() could not finish for want of blocks (none by default)."""
        return Feed()

    # ---- helpers

    @abstractmethod
    def _catch_up(self, step: TargetStep) -> Feed:
        """What the draft feeds after the target's step (and updates its slots' state for it)."""

    @abstractmethod
    def _chain_position(self, num_tokens: int, j: int) -> int:
        """The position the chain's j-th step (1..k-1) writes for a sequence of num_tokens tokens."""

    def _step(self, slots: list[int], lens: list[int], j: int, ids: torch.Tensor, feature: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        seq_lens = [self._chain_position(n, j) + 1 for n in lens]
        if self.graphs is not None and self.graphs.size_for(len(slots)) is not None:
            return self._replay(slots, seq_lens, ids, feature)
        meta = self._plan(slots, [1] * len(slots), seq_lens)
        rows = torch.arange(len(slots), device=self.device)
        return self._forward(ids, meta, rows, feature)

    # ---- CUDA graphs of the chain's one-token steps

    def capture_graphs(self, sizes: list[int]) -> None:
        """Capture the chain step at these batch sizes (CUDA, a backend that captures; after attach()):
        a step is then one replay, like the target's decode steps (app/worker/cuda_graphs.py), its pad
        rows on the scratch block (the cache's last). A catch-up that fits replays it too, one row per
        token (a verify's kept positions); longer ones (prefill chunks) run eagerly."""
        assert self.cache is not None and self.attention is not None and self.block_tables is not None
        self.step_module = _ChainStep(self, max(sizes))
        self.graphs = DecodeGraphs(self.step_module, self.attention, sizes, self.block_tables.shape[1],
                                   self.block_size, self.cache.num_blocks - 1, self.draft_vocab_size, self.device)
        self.graphs.capture()

    def _replay(self, slots: list[int], seq_lens: list[int], ids: torch.Tensor, feature: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of one token each (a slot may have several, at consecutive lengths) through the captured
        step: each row's draft (target ids) and feature."""
        assert self.graphs is not None and self.step_module is not None and self.block_tables is not None
        n, step = len(slots), self.step_module
        if feature is not None:
            step.feature_in[:n].copy_(feature)
        self.graphs.run(slots, seq_lens, self.block_tables, None, input_ids=ids)
        return step.ids_out[:n].clone(), step.feature_out[:n].clone()

    def _plan(self, slots: list[int], query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        assert self.attention is not None and self.block_tables is not None, "attach() the drafter first"
        index = upload(slots, torch.int64, self.device)
        batch = build_attention_batch(self.block_tables.index_select(0, index), query_lens, seq_lens,
                                      self.block_size)
        return self.attention.plan(batch)

    def _run_feed(self, feed: Feed) -> None:
        """Run the catch-up rows, in forwards of at most max_tokens tokens (a long prefill chunk is cut);
        the rows that sample set their slot's `first` and `feature`."""
        for part in _split_feed(feed, self.max_tokens):
            flat = [t for tokens in part.tokens for t in tokens]
            qlens = [len(t) for t in part.tokens]
            ids, ends = upload([*flat, *itertools.accumulate(qlens)], torch.int64, self.device).split(
                [len(flat), len(qlens)])
            ends = ends - 1
            if self.graphs is not None and self.graphs.size_for(len(flat)) is not None:
                # One graph row per token, each at its own position (app/worker/cuda_graphs.py).
                rows = [(slot, start + j + 1) for slot, start, n in zip(part.slots, part.starts, qlens, strict=True)
                        for j in range(n)]
                features = part.feature_rows()
                features = self._chain_feature(features) if features is not None else None
                first, feature = self._replay([r[0] for r in rows], [r[1] for r in rows], ids, features)
                first, feature = first.index_select(0, ends), feature.index_select(0, ends)
            else:
                meta = self._plan(part.slots, qlens, [s + n for s, n in zip(part.starts, qlens, strict=True)])
                first, feature = self._forward(ids, meta, ends, part.feature_rows())
            sampled = [i for i, s in enumerate(part.sample) if s]
            if sampled:
                pick, where = upload([sampled, [part.slots[i] for i in sampled]], torch.int64, self.device)
                self.first.index_copy_(0, where, first.index_select(0, pick))
                self.feature.index_copy_(0, where, feature.index_select(0, pick).to(self.feature.dtype))
                for i in sampled:
                    self.seqs[part.slots[i]].ready = True


def _split_feed(feed: Feed, limit: int) -> list[Feed]:
    """The rows as forwards of at most `limit` tokens, in order; a longer row is cut into pieces and only
    its last piece samples. A row's pieces land in different forwards (each but the last fills one)."""
    parts, current = [], Feed()
    rows = zip(feed.slots, feed.starts, feed.tokens, feed.sample, feed.features, strict=True)
    for slot, start, tokens, sample, features in rows:
        for lo in range(0, len(tokens), limit):
            piece = tokens[lo : lo + limit]
            if current.slots and current.num_tokens + len(piece) > limit:
                parts.append(current)
                current = Feed()
            part_features = None if features is None else features[lo : lo + limit]
            current.add(slot, start + lo, piece, sample and lo + limit >= len(tokens), part_features)
    if current.slots:
        parts.append(current)
    return parts


class _ChainStep(nn.Module):
    """DecodeGraphs' model interface over a drafter's one-token step: the features in and out live in
    static buffers (a graph reads and writes fixed addresses)."""

    def __init__(self, drafter: ChainDrafter, rows: int) -> None:
        super().__init__()
        self.drafter = (drafter,)  # a tuple: not a submodule
        self.dtype = drafter.feature.dtype
        self.feature_in = torch.zeros(rows, drafter.feature.shape[1], dtype=self.dtype, device=drafter.device)
        self.feature_out = torch.zeros_like(self.feature_in)
        self.ids_out = torch.zeros(rows, dtype=torch.int64, device=drafter.device)  # the target's ids

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = ids.shape[0]
        hidden, feature = self.drafter[0]._hidden(ids, positions, self.feature_in[:n], meta)
        self.feature_out[:n].copy_(feature)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits and, in the graph too, the chain's next draft from them."""
        drafter = self.drafter[0]
        logits = drafter._logits(hidden, out)
        self.ids_out[: hidden.shape[0]].copy_(drafter._to_target(logits.argmax(dim=-1)))
        return logits
