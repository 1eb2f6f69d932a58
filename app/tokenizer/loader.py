"""Load the Hugging Face tokenizer the settings name, and the EOS ids that end a generation."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from app.config.settings import Settings

logger = logging.getLogger(__name__)

TOKENIZER_MODES = ("auto",)


@contextlib.contextmanager
def transformers_without_torch() -> Iterator[None]:
    """Import transformers (for the tokenizer) as if torch were not installed, in a process that has
    imported neither yet: transformers imports torch wherever it is installed (AutoTokenizer ->
    configuration_utils -> modeling_rope_utils), 0.24 GB of resident memory that a process which only
    tokenizes never uses. A None in sys.modules makes importlib's find_spec, hence transformers'
    is_torch_available (cached for the process), report torch absent; torch itself stays importable
    afterwards (XGrammar imports it with the first grammar). A no-op where either is loaded already."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    quiet = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # no "PyTorch was not found" at import
    try:
        import transformers  # noqa: F401 (imported here, where it cannot see torch)

        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
        if quiet is None:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = quiet


def tokenizer_source(settings: Settings) -> str:
    """--tokenizer, else the model path or hub id."""
    source = settings.tokenizer or settings.model
    if not source:
        raise ValueError("no tokenizer to load: set --model (or --tokenizer)")
    return str(source)


def load_tokenizer(
    source: str,
    *,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Any:
    """AutoTokenizer.from_pretrained from a local dir or hub id.

    Only "auto" (a fast tokenizer) exists: transformers 5 ignores use_fast=False and always
    builds the fast (tokenizers-backed) class, so a "slow" mode could not be honoured.
    """
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"--tokenizer-mode {tokenizer_mode!r} is not supported: only 'auto' (fast tokenizers) is; "
            "transformers 5 has no slow tokenizer path"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        source, trust_remote_code=trust_remote_code, revision=revision, cache_dir=download_dir,
    )
    logger.info("loaded tokenizer %s (%s, %d tokens)", source, type(tokenizer).__name__, len(tokenizer))
    return tokenizer


def load_tokenizer_from_settings(settings: Settings) -> Any:
    return load_tokenizer(
        tokenizer_source(settings),
        tokenizer_mode=settings.tokenizer_mode,
        trust_remote_code=bool(settings.trust_remote_code),
        revision=settings.revision,
        download_dir=settings.download_dir,
    )


def eos_token_ids(
    tokenizer: Any, source: str, *, revision: str | None = None, download_dir: str | None = None
) -> list[int]:
    """The tokenizer's EOS id first, then those of generation_config.json (deduplicated)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for tid in _generation_config_eos(source, revision, download_dir):
        if tid not in ids:
            ids.append(tid)
    return ids


def _generation_config_eos(source: str, revision: str | None, download_dir: str | None) -> list[int]:
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(source, revision=revision, cache_dir=download_dir)
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        return []
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


def vocab_size(tokenizer: Any) -> int:
    """Ids the tokenizer can produce or decode, added tokens included."""
    return len(tokenizer)
