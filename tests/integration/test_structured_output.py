"""Structured output through the whole appliance on SmolLM2 (and a tiny random model): every output
matches its JSON schema, regex or EBNF, streamed or not, beside unconstrained requests, under preemption,
with seeds, n, logprobs, stop strings and max_tokens; bad grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tests.support.appliance import Appliance

RECIPE = "configs/recipes/smollm2-135m-instruct.yaml"
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
NESTED = {"type": "object", "required": ["user", "tags"], "properties": {
    "user": {"type": "object", "required": ["id", "email"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
             "minItems": 1, "maxItems": 3}}}
REF_ANYOF = {"$defs": {"point": {"type": "object", "required": ["x", "y"], "properties": {
    "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}}},
    "type": "object", "required": ["shape", "count"], "properties": {
        "shape": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "string", "enum": ["none"]}]},
        "count": {"type": "integer", "minimum": 0, "maximum": 5}}}
SCHEMAS = {"person": PERSON, "nested": NESTED, "ref_anyof": REF_ANYOF}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SUM_EBNF = 'root ::= num " + " num\nnum ::= [1-9] [0-9]? [0-9]?'


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def client(smol) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol.base_url}/v1", api_key="x", max_retries=0, timeout=120)


MODEL = "smollm2-135m-instruct"


def chat(app: Appliance, content: str, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 120, **body}
    return httpx.post(f"{app.base_url}/v1/chat/completions", json=payload, timeout=120)


def chat_text(app: Appliance, content: str, stream: bool, **body) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        r = chat(app, content, **body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 120,
               "stream": True, **body}
    text, finish = "", None
    with httpx.stream("POST", f"{app.base_url}/v1/chat/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


def generate(app: Appliance, text: str, **sampling) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 100, "temperature": 0, **sampling}}
    r = httpx.post(f"{app.base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def preemptions(app: Appliance) -> float:
    text = httpx.get(f"{app.base_url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "tokenspeed:num_preemptions"
               for s in f.samples if s.name.endswith("_total"))


def test_json_schema_outputs_validate_streamed_or_not(smol) -> None:
    cases = [(name, False) for name in SCHEMAS] + [("person", True)]

    def run(case):
        name, stream = case
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        return chat_text(smol, f"Give me an example {name} object as JSON.", stream, response_format=fmt,
                         temperature=0)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (name, _), (text, finish) in zip(cases, results, strict=True):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert results[-1] == results[0]  # streamed: the same greedy output
    text, finish = chat_text(smol, "Describe a cat.", False, response_format={"type": "json_object"}, temperature=0)
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_regex_and_ebnf_outputs_match(smol, client) -> None:
    out = generate(smol, "My phone number is", regex=PHONE)
    assert re.fullmatch(PHONE, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    out = generate(smol, "Two plus three:", ebnf=SUM_EBNF)
    assert re.fullmatch(r"[1-9]\d{0,2} \+ [1-9]\d{0,2}", out["text"]), out["text"]
    stream = client.completions.create(model=MODEL, prompt="Colors:", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"guided_regex": "(red|green|blue)(, (red|green|blue)){2}"})
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert re.fullmatch("(red|green|blue)(, (red|green|blue)){2}", text), text
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is fire hot?"}],
                                            extra_body={"guided_choice": ["yes", "no"]}, temperature=0)
    assert choice.choices[0].message.content in ("yes", "no")


def test_bad_grammars_are_400s_naming_the_field(smol) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_json": PERSON}, "cannot be combined"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ]
    for body, fragment in cases:
        r = chat(smol, "hi", **body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = httpx.post(f"{smol.base_url}/generate", json={"text": "x", "sampling_params": {"ebnf": "root ::= ("}},
                   timeout=60)
    assert r.status_code == 400 and "sampling_params.ebnf" in r.json()["error"]["message"], r.text
    assert generate(smol, "still", regex="ok")["text"] == "ok"  # the engine goes on


def test_seeds_and_n_reproduce_valid_outputs(client) -> None:
    def sample() -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], n=2, seed=1234,
            temperature=1.0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.message.content for c in r.choices]

    first, second = sample(), sample()
    assert first == second
    for text in first:
        jsonschema.validate(json.loads(text), PERSON)


def test_logprobs_come_from_the_masked_distribution(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a color."}], max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=10, extra_body={"guided_choice": ["green", "blue"]})
    first = r.choices[0].logprobs.content[0]
    allowed = [alt for alt in first.top_logprobs if alt.logprob > -9999]
    assert allowed and all("green".startswith(a.token) or "blue".startswith(a.token) for a in allowed)
    assert all(alt.logprob == -9999.0 for alt in first.top_logprobs if alt not in allowed)
    assert sum(2.718281828 ** a.logprob for a in allowed) == pytest.approx(1.0, abs=1e-3)  # renormalised
    assert r.choices[0].message.content in ("green", "blue")


def test_stop_strings_and_max_tokens_still_end_constrained_output(smol) -> None:
    out = generate(smol, "Count:", regex="(ab){40}", max_new_tokens=5)
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 5
    out = generate(smol, "Phone:", regex=PHONE, stop=[") "])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ") "}
    assert re.fullmatch(r"\(\d{3}", out["text"]), out["text"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


def test_openai_parse_helper_with_a_pydantic_model(client) -> None:
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
        temperature=0, max_tokens=80)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_tiny_model_concurrent_with_unconstrained_under_preemption(tiny_model_dirs, log_dir) -> None:
    """Random weights want nothing in particular: the grammar alone shapes the output, beside unconstrained
    requests and across the preemptions of a 128-token pool (recomputed sequences replay their matcher)."""
    flags = ("--block-size", "4", "--max-total-tokens", "128", "--max-model-len", "64", "--enable-metrics")
    with Appliance(tiny_model_dirs["qwen2"], *flags, log_dir=log_dir) as app:
        regex = r"(a|b|c)( (a|b|c)){11}"
        # One batch, so every sequence is admitted together: three free 50-token sequences alone need more
        # than the pool holds, whatever the machine's speed.
        free = {"max_new_tokens": 50, "ignore_eos": True, "temperature": 0}
        constrained = [{"regex": regex, "temperature": 1.0, "seed": i, "max_new_tokens": 40} for i in range(6)]
        body = {"text": [f"y{i}" for i in range(3)] + [f"x{i}" for i in range(6)],
                "sampling_params": [free] * 3 + constrained}
        r = httpx.post(f"{app.base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        outs = r.json()
        assert all(o["meta_info"]["completion_tokens"] == 50 for o in outs[:3])
        assert all(re.fullmatch(regex, o["text"]) for o in outs[3:]), [o["text"] for o in outs[3:]]
        assert preemptions(app) > 0
        schema = {"type": "object", "required": ["k"], "properties": {"k": {"type": "boolean"}}}
        out = generate(app, "y", json_schema=json.dumps(schema), max_new_tokens=30)
        jsonschema.validate(json.loads(out["text"]), schema)
