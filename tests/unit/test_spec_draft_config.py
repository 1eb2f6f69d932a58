"""The draft-model methods' settings (STANDALONE, EAGLE3): what they need and what is theirs alone."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_settings


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(argv, {})
    return str(info.value)


def test_draft_methods_from_flags_and_json() -> None:
    s = load_settings(["m", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                       "--speculative-draft-model-quantization", "fp8", "--drafter-attention-backend", "torch"], {})
    assert (s.speculative_algorithm, s.speculative_draft_model_path, s.speculative_draft_model_quantization,
            s.drafter_attention_backend) == ("STANDALONE", "d", "fp8", "torch")
    config = '{"method": "eagle3", "model": "org/head", "num_speculative_tokens": 5}'
    s = load_settings(["m", "--speculative-config", config, "--eagle3-layers-to-capture", "1", "15", "28"], {})
    assert (s.speculative_algorithm, s.speculative_draft_model_path) == ("EAGLE3", "org/head")
    assert (s.speculative_num_steps, s.speculative_num_draft_tokens, s.eagle3_layers_to_capture) == (5, 6, [1, 15, 28])
    s = load_settings(["m", "--speculative-config", '{"method": "draft_model", "model": "d"}'], {})
    assert s.speculative_algorithm == "STANDALONE"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path (a draft model"),
    (["--speculative-draft-model-path", "d"], "--speculative-draft-model-path is for --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--drafter-attention-backend", "torch"], "STANDALONE or EAGLE3: not NGRAM"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
      "--eagle3-layers-to-capture", "1", "2", "3"], "--eagle3-layers-to-capture is for --speculative-algorithm EAGLE3"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h", "--eagle3-layers-to-capture", "1",
      "2"], "needs three layer ids"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h",
      "--speculative-draft-model-quantization", "fp8"], "an EAGLE-3 head runs unquantized"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
      "--speculative-draft-model-quantization", "nvfp4"], "--speculative-draft-model-quantization nvfp4 is not"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
      "--drafter-attention-backend", "fa3"], "--drafter-attention-backend fa3 is not supported yet"),
])
def test_refused_draft_settings_say_what_to_fix(argv: list[str], expected: str) -> None:
    assert expected in error_of(["m", *argv])
