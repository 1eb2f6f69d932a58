"""A draft model in the whole appliance: SmolLM2 drafting for itself (STANDALONE, float32). Greedy output
equals transformers' token for token, and the drafts are accepted (almost) always (/metrics: a model
drafting for itself proposes what it then verifies; only float rounding between its batch shapes can
part them). The KV pool returns to zero afterwards. One appliance for the module."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_golden_parity import hf_greedy, served_greedy
from tests.integration.test_speculative import CODE, chat_prompt
from tests.support.appliance import Appliance

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def app(smollm2_dir, log_dir):
    flags = ("--config", "configs/recipes/smollm2-135m-instruct.yaml", "--dtype", "float32",
             "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(smollm2_dir),
             "--speculative-num-steps", "3", "--enable-metrics", "--max-num-seqs", "4")
    with Appliance(smollm2_dir, *flags, log_dir=log_dir) as appliance:
        yield appliance


def test_self_drafting_is_greedy_and_accepted(app: Appliance, smollm2_dir) -> None:
    prompts = [chat_prompt(smollm2_dir, "What is the capital of France?"),
               chat_prompt(smollm2_dir, f"Explain what this code does:\n{CODE}")]
    expected = hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    assert served_greedy(app, prompts, NEW_TOKENS) == expected
    text = httpx.get(f"{app.base_url}/metrics", timeout=10).text
    counters = {s.name.removeprefix("tokenspeed:"): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if "spec_decode" in s.name and "per_pos" not in s.name}
    drafted, accepted = counters["spec_decode_num_draft_tokens_total"], counters["spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and accepted / drafted > 0.9, counters
    assert app.wait_idle(timeout=30)["num_used_blocks"] == 0
