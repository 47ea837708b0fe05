"""Write the packaged default prompt set: code-completion prompts cut from the held-out stdlib
files (a function's signature and docstring, as HumanEval does) plus a few English prompts.

    python tools/make_default_prompts.py [--n-code 24]

Deterministic: held-out files in sorted order, the first functions with a docstring in each.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import iter_documents  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime", "assets", "prompts",
                   "default.jsonl")
ENGLISH = [
    "The built-in function len() returns",
    "A generator is a function that",
    "To open a file for reading in Python, use",
    "Exceptions are raised when",
    "The with statement is used to",
    "A dictionary maps keys to values. To iterate over",
    "Unicode strings in Python 3 are",
    "The import system searches sys.path for",
]


def code_prompts(limit: int, per_file: int = 2) -> list[dict]:
    out = []
    for rel, text in iter_documents("heldout"):
        if not rel.endswith(".py") or "::" in rel:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        taken = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.body:
                doc = node.body[0]
                prompt = "\n".join(lines[node.lineno - 1:doc.end_lineno]) + "\n"
                if 40 <= len(prompt) <= 800:
                    out.append({"source": rel, "category": "code", "prompt": prompt})
                    taken += 1
                    if taken >= per_file:
                        break
        if len(out) >= limit:
            break
    return out[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-code", type=int, default=24)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    records = code_prompts(args.n_code) + [{"source": "english", "category": "english", "prompt": p} for p in ENGLISH]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
