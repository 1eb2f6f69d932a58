"""The sampling fields both HTTP APIs share (app/http/sampling.py: SamplingBody): declared once, renamed where
an API names them otherwise, and mapped to the engine's SamplingParams the same way from either API."""

from __future__ import annotations

from typing import Any

import pytest

from app.http.errors import APIError
from app.http.native import NativeSampling
from app.http.openai_schemas import OPENAI_RENAMES, SamplingFields, parse_chat, parse_completion
from app.http.sampling import SamplingBody
from app.protocol import SamplingParams

VOCAB = 100
# One value, not the default, for every shared field (under the engine's names).
VALUES: dict[str, Any] = {
    "max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
    "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {"3": 1.5},
    "seed": 11, "stop": ["x"], "stop_token_ids": [4], "ignore_eos": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "no_stop_trim": True,
}
EXPECTED = SamplingParams(**{**VALUES, "logit_bias": {3: 1.5}})


def openai_body(values: dict[str, Any]) -> dict[str, Any]:
    return {SamplingFields.api_name(name): value for name, value in values.items()}


def test_every_shared_field_has_a_value_here() -> None:
    assert set(VALUES) == set(SamplingBody.model_fields)
    assert all(getattr(EXPECTED, name) != getattr(SamplingParams(), name) for name in VALUES)


def test_both_apis_map_every_shared_field_to_the_same_engine_parameters() -> None:
    native = NativeSampling.model_validate(VALUES).sampling(VOCAB, "sampling_params", None)
    _, completion = parse_completion({"prompt": "hi", **openai_body(VALUES)}, VOCAB)
    _, chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], **openai_body(VALUES)}, VOCAB)
    assert native == completion == chat == EXPECTED


def test_openai_takes_its_own_names_only() -> None:
    assert {name: SamplingFields.api_name(name) for name in OPENAI_RENAMES} == OPENAI_RENAMES
    assert all(NativeSampling.api_name(name) == name for name in SamplingBody.model_fields)
    for engine_name in OPENAI_RENAMES:
        with pytest.raises(APIError) as refused:
            parse_completion({"prompt": "hi", engine_name: 1}, VOCAB)
        assert refused.value.param == engine_name and "unknown parameter" in refused.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids[0]"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias.x"),
])
def test_openai_errors_name_the_field_as_sent(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        parse_completion({"prompt": "hi", **body}, VOCAB)
    assert refused.value.param == param and f"'{param}'" in refused.value.message
