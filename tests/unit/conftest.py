"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.support.tokenizer_factory import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small fast tokenizer written by the test factory (one per test module)."""
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))
