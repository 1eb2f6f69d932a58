"""Where the model's files are: a local directory, or a Hugging Face Hub snapshot fetched once."""

from __future__ import annotations

from pathlib import Path

# Config, tokenizer and safetensors files; pytorch .bin/.pt only when --load-format pt asks for them.
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_HUB_PT_FILES = ["*.bin", "*.pt"]


def resolve_model_path(
    model: str,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """A local directory as is; anything else is a Hub repo id, downloaded into download_dir (or the
    Hugging Face cache) at `revision`. Only the files the appliance reads are fetched (plus the
    repo's Python config code when remote code is trusted)."""
    local = Path(model).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to Hub models; {model} is a local directory")
        return local
    if local.exists():
        raise ValueError(f"model path {model} is a file; give the model's directory")
    from huggingface_hub import snapshot_download  # only needed off the local path

    patterns = (
        _HUB_FILES + (_HUB_PT_FILES if load_format == "pt" else []) + (["*.py"] if trust_remote_code else [])
    )
    if load_format == "dummy":
        patterns = [p for p in patterns if p != "*.safetensors"]
    return Path(
        snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    )
