"""Hugging Face model ids: `--model org/name[@revision]` resolved to a local snapshot folder.

As transformers and mlx-lm do, through `huggingface_hub` and its cache layout
(`models--org--name/{refs,snapshots}`): offline (`HF_HUB_OFFLINE=1`) only the cache is read; online
only what s2moe loads is fetched (safetensors, config, tokenizer and generation files), and a failed
connection falls back to the cache. A path that exists is always a path, never an id.
"""

from __future__ import annotations

import os
import re

from ..errors import UsageError

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def parse_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``model`` reads as a hub id and is not an existing path, else None."""
    if os.path.exists(model) or model.endswith((".gguf", ".safetensors", ".json")) or model.startswith((".", "~")):
        return None
    m = _ID.match(model)
    return (m["repo"], m["rev"]) if m else None


def cache_dir() -> str:
    """The hub cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve(repo: str, revision: str | None = None) -> str:
    """The local snapshot folder of ``repo`` at ``revision`` (default: main)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UsageError(f"{repo}: a Hugging Face id needs huggingface_hub (pip install huggingface_hub), "
                         "or pass a local folder") from None
    try:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # huggingface_hub < 0.24
        from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    cache = cache_dir()
    where = f"{repo}@{revision}" if revision else repo
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=PATTERNS,
                                 local_files_only=offline())
    except LocalEntryNotFoundError:
        mode = "HF_HUB_OFFLINE=1" if offline() else "the Hub could not be reached"
        raise UsageError(f"{where}: not in the Hugging Face cache {cache} ({mode}); download it once online "
                         "or pass --model with a local folder or .gguf file") from None
    except HfHubHTTPError as exc:  # a repository or revision the Hub does not have, or gated
        raise UsageError(f"{where}: the Hugging Face Hub refused it ({str(exc).splitlines()[0]}); check the id "
                         "and revision, or pass a local folder") from None
