"""Speculative decoding settings: --speculative-config expanded into the flags, and their rules."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_settings


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(argv, {})
    return str(info.value)


def test_ngram_flags_and_derived_draft_tokens() -> None:
    s = load_settings(["m", "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "5"], {})
    assert (s.speculative_algorithm, s.speculative_num_steps, s.speculative_num_draft_tokens) == ("NGRAM", 5, 6)
    assert (s.speculative_ngram_min_match_window_size, s.speculative_ngram_max_match_window_size) == (1, 12)


def test_json_config_fills_the_flags() -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    s = load_settings(["m", "--speculative-config", config], {})
    assert s.speculative_algorithm == "NGRAM"
    assert (s.speculative_num_steps, s.speculative_num_draft_tokens) == (4, 5)
    assert (s.speculative_ngram_min_match_window_size, s.speculative_ngram_max_match_window_size) == (2, 5)
    s = load_settings(["m", "--speculative-config", '{"algorithm": "NGRAM", "num_steps": 2}'], {})
    assert (s.speculative_algorithm, s.speculative_num_draft_tokens) == ("NGRAM", 3)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--speculative-config", '{"method": "ngram", "draft": 1}'], "--speculative-config has unknown keys ['draft']"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "must be an integer >= 1"),
    (["--speculative-config", '{"method": "bogus"}'], "'BOGUS' is not one of"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--speculative-num-steps", "2"],
     "contradicts --speculative-num-steps 2"),
    (["--speculative-config", '{"method": "mtp"}'], "--speculative-algorithm MTP is not supported yet"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm DFLASH is not supported yet"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3"],
     "--speculative-num-draft-tokens 3 must be --speculative-num-steps + 1 = 4"),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "2"], "tree speculation is not supported yet"),
    (["--speculative-num-steps", "2"], "--speculative-num-steps has no effect without --speculative-algorithm"),
    (["--speculative-ngram-max-match-window-size", "3"], "has no effect without"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "4",
      "--speculative-ngram-max-match-window-size", "3"], "must be <= --speculative-ngram-max-match-window-size 3"),
])
def test_refused_combinations_say_what_to_fix(argv: list[str], expected: str) -> None:
    assert expected in error_of(["m", *argv])
