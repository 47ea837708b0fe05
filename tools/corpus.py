"""Offline training corpus for the embedded default model.

Every Python install carries the same text: the standard library's own ``.py``
sources plus the English help topics in ``pydoc_data/topics.py``.  This module
enumerates them deterministically and splits them *by file* into a training
part and a held-out part, so that training and evaluation scripts agree on the
split without shipping any data.

Documents are ``(relpath, text)`` pairs.  Code documents use the path relative
to the stdlib directory; help topics use ``pydoc_data/topics.py::<topic>``.
"""

import ast
import hashlib
import os
import sysconfig

MAX_FILE_BYTES = 500_000            # skips generated blobs (the topics file itself, big tables)
HELD_OUT_PERCENT = 3                # sha1(relpath) % 100 < 3  ->  held out
TOPICS_RELPATH = "pydoc_data/topics.py"
# Directory names whose contents are tests or third-party installs, not the stdlib proper.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_dir():
    return sysconfig.get_paths()["stdlib"]


def is_held_out(relpath):
    """Seeded-by-name split: stable across machines, runs and file additions."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def _code_relpaths(root):
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.getsize(full) > MAX_FILE_BYTES:
                continue
            paths.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(paths)


def _topic_documents(root):
    """The help topics are a literal dict of English strings; parse it rather than import it."""
    path = os.path.join(root, TOPICS_RELPATH)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            topics = ast.literal_eval(node.value)
            return [(f"{TOPICS_RELPATH}::{key}", text) for key, text in sorted(topics.items())]
    return []


def all_documents():
    """Every document in deterministic order (sorted code paths, then sorted topics)."""
    root = stdlib_dir()
    docs = []
    for rel in _code_relpaths(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            docs.append((rel, f.read()))
    docs.extend(_topic_documents(root))
    return [(rel, text) for rel, text in docs if text.strip()]


def iter_documents(split):
    """Yield (relpath, text) for split 'train', 'heldout' or 'all'."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    for rel, text in all_documents():
        if split == "all" or is_held_out(rel) == (split == "heldout"):
            yield rel, text


if __name__ == "__main__":
    for split in ("train", "heldout"):
        docs = list(iter_documents(split))
        print(split, len(docs), "documents", sum(len(t) for _, t in docs), "chars")
