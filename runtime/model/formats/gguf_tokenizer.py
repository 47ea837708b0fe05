"""A Hugging Face byte-level BPE `tokenizer.json` as GGUF tokenizer metadata, as llama.cpp reads it.

llama.cpp splits text before BPE with the regular expressions of a named pre-tokenizer
(`tokenizer.ggml.pre`); with the wrong name it splits differently and the token ids differ from the
model's own tokenizer ("x = a + b" became 7 ids instead of 5 under "default"). The name is chosen
from the tokenizer's own pre-tokenizer: a byte-level pre-tokenizer with its built-in regex is GPT-2's
split, and a Split on one of the known patterns names that family's split. Anything else is written
as "default" with a warning, since no name would reproduce it.
"""

from __future__ import annotations

import sys

from ... import jsonfile
from ...errors import UsageError

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Split patterns of tokenizer.json → llama.cpp's pre-tokenizer names
KNOWN_SPLITS = {
    GPT2: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def pre_tokenizer_name(spec: dict) -> str | None:
    """llama.cpp's name for ``tokenizer.json``'s pre-tokenizer, or None when none matches."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = [s for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(steps) == 1 and byte_level and byte_level[0].get("use_regex", True):
        return "gpt-2"  # ByteLevel's own regex is GPT-2's split
    if len(splits) == 1 and len(byte_level) == 1 and not byte_level[0].get("use_regex", True):
        pattern = (splits[0].get("pattern") or {}).get("Regex")
        return KNOWN_SPLITS.get(pattern)
    return None


def add_tokenizer(w, tokenizer_json: str, vocab_size: int | None = None) -> None:
    """A byte-level BPE `tokenizer.json` as GGUF's `gpt2` tokenizer (tokens, merges, types) and
    the pre-tokenizer llama.cpp must split with. llama.cpp sizes the vocabulary by the token list,
    so it is padded with unused entries to the model's ``vocab_size`` (embedding rows)."""
    try:
        with open(tokenizer_json, encoding="utf-8") as f:
            spec = jsonfile.load(f)
    except (OSError, ValueError) as exc:  # ValueError: malformed JSON, a nested-JSON bomb, not UTF-8
        raise UsageError(f"{tokenizer_json}: not a readable tokenizer.json ({exc}); fix or remove it (convert then writes no tokenizer)") from None
    if not isinstance(spec, dict):
        raise UsageError(f"{tokenizer_json}: not a tokenizer.json (expected a JSON object)")
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UsageError(f"{tokenizer_json}: only BPE tokenizers can be embedded in GGUF (found {model.get('type')})")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    size = max(max(vocab.values()) + 1, vocab_size or 0)
    tokens = [f"[PAD{i}]" for i in range(size)]
    for tok, i in vocab.items():
        tokens[i] = tok
    known = set(vocab.values())
    # 3 = control, 1 = normal, 5 = unused (the padding)
    types = [3 if t in special else 1 if i in known else 5 for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = pre_tokenizer_name(spec)
    if pre is None:
        print(f"warning: {tokenizer_json}: its pre-tokenizer matches none llama.cpp names; written as "
              "'default', so llama.cpp may split text differently", file=sys.stderr)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
