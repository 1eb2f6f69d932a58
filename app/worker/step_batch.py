"""The host-side layout of one step's flat batch: the plan's chunks one after another, with the rows
that feed a sampled token (decode), the rows that sample and the rows whose prompt logprobs are asked."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.protocol import SeqChunk
from app.worker.sampling.prompt_logprobs import PromptRows, PromptWant


@dataclass
class StepBatch:
    """The host-side layout of one step's flat batch."""

    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # decode rows hold a placeholder
    decode_rows: list[int] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_slots: list[int] = field(default_factory=list)
    prompt: PromptRows = field(default_factory=PromptRows)  # rows whose prompt logprobs are asked


def lay_out(chunks: list[SeqChunk], seq_len: list[int], prompt_want: dict[int, PromptWant]) -> StepBatch:
    """The step's rows; seq_len is every slot's context before the step, prompt_want the slots whose
    prompt logprobs are asked."""
    step = StepBatch()
    for chunk in chunks:
        row = len(step.token_ids)
        if chunk.token_ids:
            want = prompt_want.get(chunk.slot)
            if want is not None:  # before the chunk's tokens: row is its first row
                step.prompt.add(want, chunk.slot, row, seq_len[chunk.slot], len(chunk.token_ids))
            step.token_ids += chunk.token_ids
        else:
            step.token_ids.append(0)
            step.decode_rows.append(row)
            step.decode_slots.append(chunk.slot)
        n = len(step.token_ids) - row
        step.slots.append(chunk.slot)
        step.query_lens.append(n)
        step.seq_lens.append(seq_len[chunk.slot] + n)
        if chunk.sample:
            step.sample_rows.append(row + n - 1)
            step.sample_slots.append(chunk.slot)
    return step

