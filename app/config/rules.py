"""Rules that tie several settings together (the per-field ranges live on the fields).

TP size versus attention heads needs the model's config, so the worker checks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config.errors import Problem

if TYPE_CHECKING:
    from app.config.settings import Settings


def cross_field_problems(s: Settings) -> list[Problem]:
    problems: list[Problem] = []
    if s.chunked_prefill_size == -1 and s.max_model_len is not None and s.max_prefill_tokens < s.max_model_len:
        problems.append(Problem(
            ("max_prefill_tokens", "max_model_len", "chunked_prefill_size"),
            f"--max-prefill-tokens {s.max_prefill_tokens} must be >= --max-model-len {s.max_model_len} when "
            "chunked prefill is off (--chunked-prefill-size -1): a whole prompt must fit in one prefill",
        ))
    if s.max_total_tokens is not None:
        if s.max_total_tokens < s.block_size:
            problems.append(Problem(
                ("max_total_tokens", "block_size"),
                f"--max-total-tokens {s.max_total_tokens} is smaller than one KV block (--block-size "
                f"{s.block_size})",
            ))
        if s.max_model_len is not None and s.max_total_tokens < s.max_model_len:
            problems.append(Problem(
                ("max_total_tokens", "max_model_len"),
                f"--max-total-tokens {s.max_total_tokens} must be >= --max-model-len {s.max_model_len}: "
                "a sequence of the maximum length must fit in the KV pool",
            ))
    return problems
