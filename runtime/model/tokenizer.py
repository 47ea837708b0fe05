"""Tokenizers: `tokenizer.json` through the `tokenizers` library, or rebuilt from GGUF metadata."""

from __future__ import annotations

import os

from ..errors import ModelFormatError, UnsupportedModelError


def load_tokenizer(model, override: str | None = None):
    """The tokenizer for a `LoadedModel`: ``override`` (a tokenizer.json or folder holding one),
    else the HF folder's tokenizer.json, else the GGUF vocabulary."""
    from tokenizers import Tokenizer

    path = override or model.tokenizer_path
    if path:
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        try:
            return Tokenizer.from_file(path)
        except Exception as exc:
            raise ModelFormatError(f"{path}: cannot read tokenizer ({str(exc).splitlines()[0]})") from None
    if model.gguf is not None:
        return tokenizer_from_gguf(model.gguf)
    raise ModelFormatError(f"{model.path}: no tokenizer.json; pass --tokenizer PATH")


def tokenizer_from_gguf(index):
    """GGUF `gpt2`-style byte-level BPE (tokens + merges) → a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = index.metadata.get("tokenizer.ggml.model")
    tokens = index.array("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelFormatError(f"{index.path}: GGUF has no tokenizer; pass --tokenizer PATH")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{index.path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only); pass --tokenizer PATH"
        )
    merges = [tuple(m.split(" ", 1)) for m in (index.array("tokenizer.ggml.merges") or [])]
    types = index.array("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    if special:
        tok.add_special_tokens(special)
    return tok
