"""The runner's side of speculative decoding: turn planned decodes into verify rows, and verify them.

A decode chunk with num_draft > 0 (protocol.SeqChunk) asks for drafts: expand() gets them from the
proposer and feeds [last token, d_1 .. d_m] as an extend of m + 1 positions over the slot's paged KV,
in the same flat batch as the step's other rows; verify() reads the target's logits at those positions,
accepts a prefix of the drafts (verify.py) and sets the slot's length to what it kept (the rejected
positions' KV stays behind the length and is overwritten by later steps). A decode whose proposer found
nothing runs as a plain decode. The scheduler plans one step at a time while speculating (the accepted
count decides the next step's positions), so the host knows every token when it drafts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from app.config.settings import Settings
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepResult
from app.worker.sampling.reduce import argmax_and_bad_rows
from app.worker.slot_state import SlotState
from app.worker.spec.proposer import Proposer, TargetStep
from app.worker.spec.verify import Accepted, accept_greedy, accept_sampled, target_probs
from app.worker.step_batch import StepBatch


@dataclass
class VerifyRows:
    """The step's verify rows: slots[i] fed [last, *drafts[i]] (rows[i] is its first flat row).

    A draft made on the device stays there until the verify reads the target's tokens back: its rows'
    ids are copied into the step's input on the device (`device_tokens`), and `drafts` is filled from
    `pending` by that same read-back, so the draft's forwards run while the host lays the step out."""

    slots: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # [m, V] per row, or None
    rows: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None  # [R, k] the drafts on the device, while drafts holds placeholders

    def positions(self) -> list[int]:
        """Every fed position of every verify row, rows in order: where the target's logits are read."""
        return [row + j for row, d in zip(self.rows, self.drafts, strict=True) for j in range(len(d) + 1)]

    def device_tokens(self) -> tuple[list[int], torch.Tensor, list[int]] | None:
        """For drafts still on the device: (the flat rows they feed, the draft tensor flattened, where in
        it each row's token is); None when the host holds them."""
        if self.pending is None:
            return None
        k = self.pending.shape[1]
        pairs = [(row + 1 + j, i * k + j) for i, (row, d) in enumerate(zip(self.rows, self.drafts, strict=True))
                 for j in range(len(d))]
        return [r for r, _ in pairs], self.pending.reshape(-1), [s for _, s in pairs]

    def take_rows(self, step: StepBatch) -> int:
        """Move the verify rows out of the rows the sampler draws: their logits are read at every fed
        position, after the sampled rows' (step.sample_rows grows by those). Returns how many rows the
        sampler draws."""
        if not self.slots:
            return len(step.sample_rows)
        first = dict(zip(step.slots, itertools.accumulate([0, *step.query_lens[:-1]]), strict=True))
        self.rows = [first[slot] for slot in self.slots]
        verifying = set(self.slots)
        kept = [(row, slot) for row, slot in zip(step.sample_rows, step.sample_slots, strict=True)
                if slot not in verifying]
        step.sample_rows = [row for row, _ in kept] + self.positions()
        step.sample_slots = [slot for _, slot in kept]
        return len(kept)


@dataclass
class VerifyOut:
    """A step's verify outcome, on the host: for slots[i], the drafts verified, those accepted, the
    token sampled after them, and whether its logits were bad (NaN/inf)."""

    slots: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    bad: list[bool] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, proposer: Proposer, block_size: int, device: torch.device, vocab_size: int,
                 seed: int | None) -> None:
        self.proposer = proposer
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self._params: dict[int, SamplingParams] = {}
        self._last: dict[int, int] = {}  # each slot's newest token: the one a decode feeds first
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(torch.initial_seed() if seed is None else seed)

    # ------------------------------------------------------------------ slots

    def register(self, seq: NewSeq) -> None:
        tokens = list(seq.prompt_ids) + list(seq.output_ids)
        self._params[seq.slot] = seq.sampling
        self._last[seq.slot] = tokens[-1] if tokens else 0
        self.proposer.register(seq.slot, tokens)

    def release(self, slot: int) -> None:
        if self._params.pop(slot, None) is not None:
            self._last.pop(slot, None)
            self.proposer.release(slot)

    # ------------------------------------------------------------------ a step

    def expand(self, chunks: list[SeqChunk]) -> tuple[list[SeqChunk], VerifyRows]:
        """The step's chunks with every drafting decode turned into a verify row (drafts known)."""
        asking = [c for c in chunks if c.num_draft > 0 and not c.token_ids]
        verify = VerifyRows()
        if not asking:
            return chunks, verify
        draft = self.proposer.propose([c.slot for c in asking], max(c.num_draft for c in asking))
        # A model's drafts are read back with the verify's tokens, not now (VerifyRows).
        ids = None if self.proposer.drafts_on_device else draft.token_ids.tolist()
        replaced: dict[int, SeqChunk] = {}
        picked = []
        for i, chunk in enumerate(asking):
            m = min(draft.length(i), chunk.num_draft)
            if m == 0:
                continue
            picked.append(i)
            tokens = ids[i][:m] if ids is not None else [0] * m
            verify.slots.append(chunk.slot)
            verify.drafts.append(tokens)
            verify.draft_probs.append(None if draft.probs is None else draft.probs[i, :m])
            replaced[chunk.slot] = SeqChunk(chunk.slot, [self._last[chunk.slot], *tokens],
                                            chunk.append_block_ids, True, chunk.num_draft)
        if ids is None and picked:
            verify.pending = draft.token_ids.index_select(0, _index(picked, draft.token_ids.device))
        return [replaced.get(c.slot, c) for c in chunks], verify

    def verify(self, logits: torch.Tensor, verify: VerifyRows, slots: SlotState) -> VerifyOut:
        """Accept each verify row's drafts (logits: the target's at verify.positions(), in order); each
        slot keeps its fed positions up to the last accepted draft and will feed the token chosen after
        them next."""
        out = self._accept(logits, verify)
        kept = [slots.seq_len[slot] - len(d) + len(a) for slot, d, a in
                zip(verify.slots, verify.drafts, out.accepted, strict=True)]
        slots.set_lengths(verify.slots, kept, out.next_tokens)
        for slot in verify.slots:
            slots.has_token[slot] = True
        return out

    def trim(self, chunks: list[SeqChunk], slots: SlotState) -> None:
        """A drafting chunk's slot keeps the blocks of its kept tokens and the next one (the scheduler
        frees the rest: protocol.SeqChunk.num_draft)."""
        for chunk in chunks:
            if chunk.num_draft:
                keep = math.ceil((slots.seq_len[chunk.slot] + 1) / self.block_size)
                slots.num_blocks[chunk.slot] = min(slots.num_blocks[chunk.slot], keep)

    def _accept(self, logits: torch.Tensor, verify: VerifyRows) -> VerifyOut:
        out = VerifyOut(slots=list(verify.slots), drafted=[len(d) for d in verify.drafts])
        # Every position's argmax and whether its logits are bad (as the sampler judges rows), in one
        # read-back: the step's only wait for a greedy batch.
        argmax, bad = argmax_and_bad_rows(logits)
        parts = [argmax, bad.to(torch.int64)]
        if verify.pending is not None:
            parts.append(verify.pending.reshape(-1))
        host = torch.cat(parts).tolist()
        n = len(argmax)
        target, bad_rows = host[:n], host[n : 2 * n]
        if verify.pending is not None:  # the drafts, read back with the target's tokens
            k = verify.pending.shape[1]
            verify.drafts = [host[2 * n + i * k : 2 * n + i * k + len(d)] for i, d in enumerate(verify.drafts)]
            verify.pending = None
        offsets = [0]
        for d in verify.drafts:
            offsets.append(offsets[-1] + len(d) + 1)
        greedy = [i for i, s in enumerate(verify.slots) if self._params[s].greedy]
        sampled = [i for i, s in enumerate(verify.slots) if not self._params[s].greedy]
        results: dict[int, Accepted] = {}
        if greedy:
            rows = [target[p] for i in greedy for p in range(offsets[i], offsets[i + 1])]
            for i, acc in zip(greedy, accept_greedy(rows, [verify.drafts[i] for i in greedy]), strict=True):
                results[i] = acc
        if sampled:
            rows = [p for i in sampled for p in range(offsets[i], offsets[i + 1])]
            probs = self._probs(logits.index_select(0, _index(rows, logits.device)), verify, sampled)
            q = [verify.draft_probs[i] for i in sampled]
            draft_q = None if any(x is None for x in q) else torch.cat(q)  # type: ignore[arg-type]
            drafts = [verify.drafts[i] for i in sampled]
            for i, acc in zip(sampled, accept_sampled(probs, drafts, self._generator, draft_q), strict=True):
                results[i] = acc
        for i in range(len(verify.slots)):
            out.accepted.append(results[i].tokens)
            out.next_tokens.append(results[i].next_token)
            out.bad.append(any(bad_rows[offsets[i]:offsets[i + 1]]))
        return out

    def _probs(self, logits: torch.Tensor, verify: VerifyRows, rows: list[int]) -> torch.Tensor:
        """The target's sampling distribution at each fed position of these verify rows."""
        params: list[SamplingParams] = []
        for i in rows:
            params += [self._params[verify.slots[i]]] * (len(verify.drafts[i]) + 1)
        v, dev = self.vocab_size, logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([v if p.top_k == -1 else min(p.top_k, v) for p in params], dtype=torch.int64, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        clean = torch.nan_to_num(logits.to(torch.float32), nan=0.0, posinf=0.0, neginf=-torch.inf)
        return target_probs(clean, temperature, top_k, top_p, min_p)

    def target_step(self, chunks: list[SeqChunk], batch: StepBatch, verify: VerifyRows) -> TargetStep:
        """What the step fed (a decode: the slot's newest token; a verify row: its drafts, read back by
        now); kept and new tokens come with its result."""
        drafts = dict(zip(verify.slots, verify.drafts, strict=True))
        fed = [[c.token_ids[0], *drafts[c.slot]] if c.slot in drafts else list(c.token_ids) or [self._last[c.slot]]
               for c in chunks]
        starts = [length - n for length, n in zip(batch.seq_lens, batch.query_lens, strict=True)]
        return TargetStep([c.slot for c in chunks], fed, starts, [len(f) for f in fed], [[] for _ in chunks])

    def finish(self, step: TargetStep | None, result: StepResult, verified: VerifyOut | None) -> None:
        """The verify rows' tokens join the step's result after its sampled rows (protocol.StepResult);
        then the proposer hears what the step kept."""
        if verified is not None:
            _merge(result, verified)
        if step is not None:
            self._observe(step, result, verified)

    def _observe(self, step: TargetStep, result: StepResult, verified: VerifyOut | None) -> None:
        """The step's kept tokens (from its result), for the slots' newest token and the proposer."""
        accepted = result.accepted_ids or [[]] * len(result.slots)
        verifying = set(verified.slots) if verified is not None else set()
        new = {slot: [*extra, token] for slot, token, extra in zip(result.slots, result.token_ids, accepted,
                                                                  strict=True)}
        for i, slot in enumerate(step.slots):
            tokens = new.get(slot)
            if tokens is None or slot not in self._last:
                continue
            step.new_tokens[i] = tokens
            if slot in verifying:
                step.kept[i] = len(tokens)  # the fed token and the accepted drafts
            self._last[slot] = tokens[-1]
        self.proposer.observe(step)



def _merge(result: StepResult, out: VerifyOut) -> None:
    n = len(result.slots)
    result.accepted_ids = [[] for _ in range(n)] + out.accepted
    result.draft_counts = [0] * n + out.drafted
    result.slots = result.slots + out.slots
    result.token_ids = result.token_ids + out.next_tokens
    if result.logprobs:
        result.logprobs = result.logprobs + [None] * len(out.slots)
    result.bad_slots = result.bad_slots + [slot for slot, bad in zip(out.slots, out.bad, strict=True) if bad]


def _index(rows: list[int], device: Any) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def make_spec_decoder(settings: Settings, block_size: int, device: torch.device, vocab_size: int,
                      drafter: Proposer | None = None) -> SpecDecoder | None:
    """The decoder --speculative-algorithm asks for (None: speculation off); a model draft (STANDALONE,
    EAGLE3) comes loaded (app/worker/spec/model_drafts.py), before the KV pool is sized."""
    algorithm = settings.speculative_algorithm
    if algorithm is None:
        return None
    if drafter is not None:
        return SpecDecoder(drafter, block_size, device, vocab_size, settings.seed)
    if algorithm != "NGRAM":
        raise ValueError(f"--speculative-algorithm {algorithm} is not built (the settings refuse it)")
    from app.worker.spec.ngram import NgramProposer

    proposer = NgramProposer(settings.speculative_ngram_min_match_window_size,
                             settings.speculative_ngram_max_match_window_size)
    return SpecDecoder(proposer, block_size, device, vocab_size, settings.seed)
