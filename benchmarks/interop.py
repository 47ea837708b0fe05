"""Backs docs/performance/peer.md, "Interop: llama.cpp reads our GGUF": the default model's export
decodes the same greedy text in llama.cpp and in s2moe.

Does llama.cpp read our GGUF as we do? The embedded default model, exported by `s2moe convert`,
greedy-decoded by llama.cpp's `llama-completion` and by `s2moe run --temperature 0`.

    python benchmarks/peer.py --build                     # once: builds llama-completion too
    python benchmarks/interop.py [--binary PATH] [--type F16] [--tokens 32]

Each prompt decodes --tokens tokens in s2moe and --tokens + SPARE in llama.cpp (EOS ignored), and
llama.cpp's text must begin with s2moe's. On a loaded machine llama-completion printed a token more or
less of the same generation from run to run (4 of 16 runs beside two CPU burners), so its text is
compared up to s2moe's length, never cut at its own count. llama-completion prints its text followed
by two newlines, which are removed. Results: a table on stderr, JSON in docs/results/interop.json
(machine, commit, prompts, both texts).
tests/test_interop.py runs the same comparison when S2MOE_LLAMA_CPP names the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import write_json  # noqa: E402

PROMPTS = ("def fibonacci(n):", "import os", "class Stack:", "x = a + b")
TRAILER = "\n\n"  # llama-completion's own output after the generation
SPARE = 8  # llama.cpp's tokens past s2moe's: its printed text may end a token early or late


def llama_text(binary: str, gguf: str, prompt: str, tokens: int) -> str:
    out = subprocess.run([binary, "-m", gguf, "-p", prompt, "-n", str(tokens), "--temp", "0", "--ignore-eos",
                          "-no-cnv", "--no-display-prompt", "--simple-io", "-t", "2", "--no-warmup"],
                         capture_output=True, text=True, errors="surrogateescape", timeout=300, check=True).stdout
    return out[: -len(TRAILER)] if out.endswith(TRAILER) else out


def s2moe_text(gguf: str, prompt: str, tokens: int) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "--model", gguf, "-p", prompt,
                          "-n", str(tokens), "-t", "0", "--method", "ar", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    record = json.loads(out)
    return record["text"], record["tokens"]


def export(out: str, kind: str) -> None:
    subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "convert", "--out", out, "--type", kind],
                   capture_output=True, text=True, timeout=600, check=True)


def compare(binary: str, gguf: str, prompts=PROMPTS, tokens: int = 32) -> list[dict]:
    rows = []
    for prompt in prompts:
        ours, ids = s2moe_text(gguf, prompt, tokens)
        theirs = llama_text(binary, gguf, prompt, tokens + SPARE)
        rows.append({"prompt": prompt, "tokens": len(ids), "s2moe": ours, "llama.cpp": theirs,
                     "equal": len(theirs) > len(ours) and theirs.startswith(ours)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.environ.get("S2MOE_LLAMA_CPP",
                                                      os.path.expanduser("~/.cache/s2moe-peer/build/bin/llama-completion")))
    ap.add_argument("--type", default="F16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "results", "interop.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = os.path.join(tmp, f"default-{args.type.lower()}.gguf")
        export(gguf, args.type)
        rows = compare(args.binary, gguf, tokens=args.tokens)
    for r in rows:
        print(f"{'equal' if r['equal'] else 'DIFFERENT':9} {r['prompt']!r}: {r['s2moe']!r}"
              + ("" if r["equal"] else f" vs {r['llama.cpp']!r}"), file=sys.stderr)
    record = {"type": args.type, "tokens": args.tokens, "rows": rows, "equal": sum(r["equal"] for r in rows)}
    write_json(args.out, record, indent=1)
    print(f"{record['equal']}/{len(rows)} prompts equal; wrote {args.out}", file=sys.stderr)
    sys.exit(0 if record["equal"] == len(rows) else 1)


if __name__ == "__main__":
    main()
