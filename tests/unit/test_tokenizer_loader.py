"""Loading the tokenizer from settings, and the EOS ids it reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.tokenizer.loader import eos_token_ids, load_tokenizer, load_tokenizer_from_settings, tokenizer_source
from tests.support.settings import make_settings
from tests.support.tokenizer_factory import VOCAB_SIZE, build_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def test_source_prefers_tokenizer_over_model():
    assert tokenizer_source(make_settings("m", tokenizer="t")) == "t"
    assert tokenizer_source(make_settings("m")) == "m"


def test_load_from_local_dir(tok_dir):
    tok = load_tokenizer_from_settings(make_settings(str(tok_dir)))
    assert tok.is_fast
    assert len(tok) <= VOCAB_SIZE
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_slow_mode_is_rejected(tok_dir):
    with pytest.raises(ValueError, match="tokenizer-mode 'slow' is not supported"):
        load_tokenizer(str(tok_dir), tokenizer_mode="slow")


def test_eos_from_tokenizer_only(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    assert eos_token_ids(tok, str(tok_dir)) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_eos_merges_generation_config(tok_dir, tmp_path):
    for f in tok_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(str(tmp_path))
    assert eos_token_ids(tok, str(tmp_path)) == [2, 0]


def test_tokenizer_process_loads_without_torch(tok_dir):
    """The tokenizer process's imports and its tokenizer leave torch unloaded (0.24 GB of RSS), and torch
    stays importable afterwards (XGrammar needs it with the first grammar)."""
    code = (
        "import sys\n"
        "from app.tokenizer.process import run_tokenizer\n"
        "from app.tokenizer.loader import load_tokenizer, transformers_without_torch\n"
        "with transformers_without_torch():\n"
        f"    tok = load_tokenizer({str(tok_dir)!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert tok.decode(tok.encode('Hello, world!')) == 'Hello, world!'\n"
        "import torch\n"
        "assert torch.ones(2).sum().item() == 2\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr
