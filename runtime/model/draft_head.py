"""A draft head over the most frequent tokens (FR-Spec, arXiv 2502.14856).

Every pass ends in the lm head, V × H weights read for each token; on a large-vocabulary model it
is the largest dense read a draft pass makes. A draft restricted to the N most frequent tokens of a
corpus reads N × H instead. Verification keeps the full head, so the output is unchanged: the draft
can only propose tokens of its subset, and verification emits the target's own token wherever the
draft's is not it.

Under sampling the draft's law q is the softmax over the subset (0 elsewhere), and speculative
sampling is exact for any q.

The head holds no bytes of its own where it can: the full head's rows are stored in rank order
(`head_order`, permuted in place once), so the N most frequent tokens' rows are its first N rows,
and the draft's head is a view of them. Logits of the full head are put back in token order after
each pass (model/forward.py). A tied embedding looks its rows up through the same order.

The ranking comes from a token-ranks file (``token_ranks.json`` in the model's folder, or beside a
GGUF as ``NAME.token_ranks.json``, or ``--token-ranks FILE``), written by `s2moe vocab` from a text
corpus: token ids by descending count.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError

RANKS_FILE = "token_ranks.json"
FORMAT = "s2moe-token-ranks"


@dataclass(frozen=True, eq=False)
class DraftHead:
    ids: np.ndarray  # int64 [N]: the tokens the draft may propose, in the order of ``weight``'s rows
    weight: object  # the lm head's rows ``ids``, in the head's own encoding and place
    vocab_size: int

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def expand(self, sub: np.ndarray) -> np.ndarray:
        """[T, N] logits over the subset → [T, V], −inf outside it (probability 0 there)."""
        out = np.full((sub.shape[0], self.vocab_size), -np.inf, dtype=np.float32)
        out[:, self.ids] = sub
        return out


@dataclass(frozen=True, eq=False)
class HeadOrder:
    """How a full head's rows are stored once a draft head shares them: row j holds token ``order[j]``."""
    order: np.ndarray  # int64 [V]: the ranked tokens by rank, then the rest (`head_order`)
    row: np.ndarray  # int64 [V]: token id → its row (the inverse of ``order``)
    ranking: str  # the ranks file the order came from


def select_rows(W, ids: np.ndarray, backend):
    """The rows ``ids`` of a head matrix, a copy in its own encoding (stored or float) and place."""
    if hasattr(W, "rows"):  # StoredMatrix (host) or DeviceStored: its bytes, row by row
        return W.rows(ids)
    picked = W[backend.to_device(ids) if backend.on_device else ids]
    # host float heads are kept input-major (see model/dense.py): keep the copy's layout the same
    return np.asfortranarray(picked) if isinstance(W, np.ndarray) and W.flags.f_contiguous else picked


def head_order(ranks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Every token id once: the ranked ones by rank, then the rest ascending. Rows stored in this
    order make every head of this ranking a prefix of the full head."""
    rest = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), ranks, assume_unique=True)
    return np.concatenate([ranks, rest])


def permute_rows(W, order: np.ndarray):
    """``W`` (a StoredMatrix) with row j holding what row ``order[j]`` held: in its own buffer,
    cycle by cycle with one row of scratch, so the budget needs no second head. A read-only buffer
    (none of the loader's are) gets a copy, which the plan does not hold."""
    N = W.shape[0]
    rows = W.data.reshape(N, W.row_bytes)
    if not rows.flags.writeable:
        return W.rows(order)
    src = order.tolist()
    done = bytearray(N)
    for i in range(N):
        if done[i] or src[i] == i:
            continue
        first, j = rows[i].copy(), i
        while True:  # follow the cycle: row j takes row src[j] until the cycle closes on i
            done[j] = 1
            k = src[j]
            if k == i:
                rows[j] = first
                break
            rows[j] = rows[k]
            j = k
    return W


def default_ranks_path(model_path: str) -> str:
    """Where a model's ranks file lives: in its folder, or beside a single file as NAME.token_ranks.json."""
    if os.path.isdir(model_path):
        return os.path.join(model_path, RANKS_FILE)
    return os.path.splitext(model_path)[0] + "." + RANKS_FILE


def load_token_ranks(path: str, vocab_size: int) -> np.ndarray:
    """Token ids by descending frequency, checked against the model's vocabulary."""
    from .. import jsonfile

    try:
        with open(path, encoding="utf-8") as f:
            data = jsonfile.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: token-ranks file not found; write one with s2moe vocab --corpus FILE "
                         f"--out {path}") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise UsageError(f"{path}: not a token-ranks JSON file; rewrite it with s2moe vocab") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{path}: field 'format' must be {FORMAT!r}; write the file with s2moe vocab")
    if data.get("vocab_size") != vocab_size:
        raise UsageError(f"{path}: field 'vocab_size' is {data.get('vocab_size')!r}, the model has {vocab_size} "
                         "tokens; write ranks with this model's tokenizer (s2moe vocab --model …)")
    ranked = data.get("ranked_ids")
    if not isinstance(ranked, list) or not ranked or not all(type(i) is int for i in ranked):
        raise UsageError(f"{path}: field 'ranked_ids' must be a non-empty list of token ids")
    ids = np.asarray(ranked, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise UsageError(f"{path}: field 'ranked_ids' holds ids outside 0..{vocab_size - 1}")
    if np.unique(ids).size != ids.size:
        raise UsageError(f"{path}: field 'ranked_ids' repeats a token id; each token is ranked once")
    return ids


def subset(ranks: np.ndarray, n: int, vocab_size: int, where: str) -> np.ndarray:
    """The ``n`` best-ranked ids, ascending. A file that ranks fewer tokens cannot give ``n``."""
    if not 1 <= n <= vocab_size:
        raise UsageError(f"--draft-vocab {n}: choose 1..{vocab_size} (0 = the full vocabulary)")
    if n > ranks.size:
        raise UsageError(f"--draft-vocab {n}: {where} ranks only {ranks.size} tokens; choose at most {ranks.size} "
                         "or count a larger corpus")
    return np.sort(ranks[:n])


def ranks_file(model_path: str, ranks_path: str | None = None) -> str:
    """The ranks file a run uses: ``--token-ranks``, else the model's own (absolute)."""
    return os.path.abspath(ranks_path or default_ranks_path(model_path))


def head_ids(path: str, vocab_size: int, n: int) -> np.ndarray:
    """The ``n`` ids a draft head covers, from the ranks file ``path`` (checked)."""
    return subset(load_token_ranks(path, vocab_size), n, vocab_size, path)


def count_tokens(encode, texts, vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in ``texts`` (``encode``: text → ids)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for text in texts:
        ids = np.asarray(encode(text), dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def ranks_document(counts: np.ndarray, source: str) -> dict:
    """The ranks file's content: tokens seen, by descending count (ties: lower id first)."""
    order = np.argsort(-counts, kind="stable")
    order = order[counts[order] > 0]
    return {"format": FORMAT, "version": 1, "vocab_size": int(counts.size), "source": source,
            "tokens_counted": int(counts.sum()), "ranked_ids": [int(i) for i in order],
            "counts": [int(counts[i]) for i in order]}


def write_ranks(path: str, document: dict) -> None:
    from ..outputs import write_atomic

    write_atomic(path, json.dumps(document, separators=(",", ":")) + "\n")
