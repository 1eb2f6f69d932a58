"""Where the model's files come from: a local directory, or a Hugging Face Hub snapshot.

A Hub model is fetched once per node: by `tokenspeed download` ahead of time, or by the supervisor
before any child starts (`prepare`), which then sets HF_HUB_OFFLINE=1 for its children so that the
tokenizer and every TP rank read that cached copy and never race to download it. Only the files
serving reads are fetched (`serving_files`). A model that cannot be had is one `ModelUnavailable`
line that names it and says what to do.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from app.config.settings import Settings

log = logging.getLogger("tokenspeed.model_files")

DEFAULT_MODEL_ENV = "TOKENSPEED_DEFAULT_MODEL_DIR"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # the embedded default that `make model` converts
# A Hub repo id: `name` or `owner/name` of letters, digits, '-', '_', '.' (the Hub's own rule).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")
_TRUE = ("1", "on", "yes", "true")
HUB_TIMEOUT_S = 10.0  # the repo listing's request; no answer by then counts as no network

# Top-level files serving reads besides the weights: configs, tokenizers, chat templates.
_SERVING = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json", "hf_quant_config.json",
    "quantize_config.json", "params.json",
)
_SAFETENSORS = ("*.safetensors", "model.safetensors.index.json")
_PT = ("*.bin", "*.pt", "pytorch_model.bin.index.json")


class ModelUnavailable(ValueError):
    """The model's files cannot be had; the message is one line that says what to do."""


def looks_local(model: str) -> bool:
    """Whether `model` is meant as a path (absolute, relative with ./ or ../, ~, more than one '/',
    or not a valid repo id) rather than a Hub repo id."""
    return model.startswith(("/", "./", "../", "~", ".")) or _REPO_ID.fullmatch(model) is None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The cache a Hub model goes to: --download-dir, else huggingface_hub's (HF_HUB_CACHE, HF_HOME)."""
    if download_dir:
        return str(Path(download_dir).expanduser())
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def serving_files(repo_files: Iterable[str], load_format: str = "auto", trust_remote_code: bool = False
                  ) -> list[str]:
    """The files of a repo that serving needs, from its file list: the top-level configs, tokenizer
    files and chat templates; safetensors (and their index) when the repo has any, else pytorch .bin/.pt
    (never .pth, .gguf, .onnx, .msgpack or .h5 weights, nor anything in a subfolder such as original/);
    no weights for --load-format dummy; the repo's Python code only when remote code is trusted.
    A repo with an index drops its consolidated*.safetensors (Mistral ships both layouts)."""
    top = [f for f in repo_files if "/" not in f]
    wanted = list(_SERVING) + (["*.py"] if trust_remote_code else [])
    has_safetensors = any(fnmatch.fnmatch(f, "*.safetensors") for f in top)
    if load_format == "safetensors" or (load_format == "auto" and has_safetensors):
        wanted += _SAFETENSORS
    elif load_format in ("pt", "auto"):
        wanted += _PT
    picked = [f for f in top if any(fnmatch.fnmatch(f, pattern) for pattern in wanted)]
    if "model.safetensors.index.json" in picked:
        picked = [f for f in picked if not (f.startswith("consolidated") and f.endswith(".safetensors"))]
    return sorted(picked)


def resolve(model: str, *, load_format: str = "auto", revision: str | None = None,
            download_dir: str | None = None, trust_remote_code: bool = False, progress: bool = False) -> Path:
    """A local directory as is; a Hub repo id from the cache, downloaded there first if it is missing
    and the Hub can be reached. Raises ModelUnavailable (or ValueError for a file or a misplaced
    --revision) with a message that says what to do."""
    local = Path(model).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to Hub models; {model} is a local directory")
        return local
    if local.exists():
        raise ValueError(f"model path {model} is a file; give the model's directory")
    if looks_local(model):
        raise ModelUnavailable(missing_local_message(model))
    return _from_hub(model, load_format, revision, download_dir, trust_remote_code, progress)


def missing_local_message(model: str) -> str:
    path = Path(model).expanduser()
    default = Path(os.environ.get(DEFAULT_MODEL_ENV) or f"~/.cache/tokenspeed/models/{DEFAULT_MODEL_NAME}")
    if path.name == DEFAULT_MODEL_NAME or path == default.expanduser():
        return (f"model directory {model} does not exist: it is the embedded default model; run `make model` "
                f"to convert it there (or set {DEFAULT_MODEL_ENV} / --model to where it is)")
    return (f"model directory {model} does not exist: give an existing directory with config.json and the "
            "weights, or a Hugging Face Hub repo id such as Qwen/Qwen3-0.6B")


def _from_hub(model: str, load_format: str, revision: str | None, download_dir: str | None,
              trust_remote_code: bool, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    cache = hub_cache_dir(download_dir)
    offline = hub_offline()
    listing = _cached_listing(model, revision, download_dir) if offline else _hub_listing(model, revision)
    if listing is None and not offline:  # the Hub is unreachable: the cache may still have it
        listing = _cached_listing(model, revision, download_dir)
        offline = True
    patterns = serving_files(listing, load_format, trust_remote_code) if listing is not None else None
    (enable_progress_bars if progress else disable_progress_bars)()
    try:
        path = snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=patterns, local_files_only=offline)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line that says what to do
        raise ModelUnavailable(_hub_failure(model, revision, cache, offline, exc)) from exc
    return Path(path)


def _hub_listing(model: str, revision: str | None) -> list[str] | None:
    """The repo's files, in one request without retries (a host without network learns it at once);
    None when the Hub cannot be reached. A repo, revision or access problem is ModelUnavailable at once
    (the cache cannot help there)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(model, revision=revision, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ModelUnavailable(f"model {model} is gated on the Hugging Face Hub: accept its license on the "
                               "Hub and set HF_TOKEN to a token that has access") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(f"model {model} is neither a local directory nor a Hugging Face Hub repo (a "
                               "private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelUnavailable(f"model {model} has no revision {revision!r} on the Hugging Face Hub") from None
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeouts, offline mode, 5xx
        log.debug("listing %s on the Hub failed: %r", model, exc)
        return None
    return [sibling.rfilename for sibling in info.siblings or []]


def _cached_listing(model: str, revision: str | None, download_dir: str | None) -> list[str] | None:
    """The repo's file list as cached with a snapshot (None without one): the same files get picked
    offline as online, so a snapshot found offline is judged complete against the same selection."""
    try:  # huggingface_hub 1.x has no cached tree: the snapshot is then taken as it is
        from huggingface_hub import get_cached_repo_tree

        tree = get_cached_repo_tree(model, revision=revision, cache_dir=download_dir)
    except Exception:  # noqa: BLE001 - CachedRepoTreeNotFoundError, ImportError, a bad cache: no listing
        return None
    return [entry.path for entry in tree]


def _hub_failure(model: str, revision: str | None, cache: str, offline: bool, exc: Exception) -> str:
    at = f" at revision {revision}" if revision else ""
    fix = (f"run `tokenspeed download {model}` where the Hub is reachable, into the same cache ({cache}: "
           "HF_HOME, HF_HUB_CACHE or --download-dir), or give a local directory")
    if hub_offline():
        return (f"model {model}{at} is neither a local directory nor in the Hugging Face cache at {cache}, and "
                f"HF_HUB_OFFLINE=1 forbids downloading it: {fix}")
    if offline:
        return (f"model {model}{at} is neither a local directory nor in the Hugging Face cache at {cache}, and "
                f"the Hub cannot be reached (no network?): {fix}")
    return f"model {model}{at} could not be downloaded into {cache}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def prepare(settings: Settings) -> float:
    """The supervisor's step before any child starts: fetch a Hub model (and a separate Hub tokenizer)
    into the cache, then set HF_HUB_OFFLINE=1 so its children read that copy. Returns the seconds it
    took (0 for local directories)."""
    import time

    started = time.perf_counter()
    fetched = False
    for source, fmt in hub_sources(settings):
        fetch(settings, source, fmt)
        fetched = True
    if fetched:
        os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by every child spawned from now on
    return time.perf_counter() - started


def fetch(settings: Settings, source: str, load_format: str) -> Path:
    """resolve() one of hub_sources(settings) with progress bars; an error about the tokenizer says so."""
    try:
        return resolve(source, load_format=load_format, revision=settings.revision,
                       download_dir=settings.download_dir, trust_remote_code=bool(settings.trust_remote_code),
                       progress=True)
    except ModelUnavailable as exc:
        if source == settings.model:
            raise
        raise ModelUnavailable(f"--tokenizer {source}: {exc}") from None


def hub_sources(settings: Settings) -> list[tuple[str, str]]:
    """What a start fetches, each with the load format that decides its weights: the model, and the
    tokenizer when it names another repo (its files only). Local directories are left out; a path
    that does not exist stays in, so that resolve() reports it."""
    out: list[tuple[str, str]] = []
    for source, fmt in ((settings.model, settings.load_format), (settings.tokenizer, "dummy")):
        if source and source not in (s for s, _ in out):
            if Path(source).expanduser().is_dir():
                continue
            out.append((source, fmt))
    return out
