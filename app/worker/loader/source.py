"""Where the model's files are: a local directory, or a Hugging Face Hub snapshot (app/model_files.py).

Under `tokenspeed serve` the supervisor has fetched a Hub model already and set HF_HUB_OFFLINE=1, so
this finds the cached copy without a network call, picking the same files."""

from __future__ import annotations

from pathlib import Path

from app.model_files import resolve


def resolve_model_path(
    model: str,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """A local directory as is; anything else a Hub repo id, from the cache (download_dir or the
    Hugging Face cache) at `revision`, downloaded first when missing and the Hub is reachable."""
    return resolve(model, load_format=load_format, revision=revision, download_dir=download_dir,
                   trust_remote_code=trust_remote_code)
