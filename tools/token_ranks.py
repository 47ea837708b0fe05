"""Write the embedded model's token_ranks.json (FR-Spec draft heads, `--draft-vocab`) from its own
training split: the Python standard library sources and help text it was trained on (tools/corpus.py),
held-out files excluded. The same counting as `s2moe vocab`; this tool only supplies the corpus.

    python tools/token_ranks.py [--out runtime/assets/default-moe/token_ranks.json]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    import corpus

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.model.draft_head import RANKS_FILE, count_tokens, ranks_document, write_ranks
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_MODEL / RANKS_FILE))
    args = ap.parse_args()
    loaded = load_model(str(DEFAULT_MODEL), dense=False)
    tok = load_tokenizer(loaded)
    texts = (text for _, text in corpus.iter_documents("train"))
    counts = count_tokens(lambda t: tok.encode(t).ids, texts, loaded.config.vocab_size)
    write_ranks(args.out, ranks_document(counts, "the embedded model's training split (tools/corpus.py: Python "
                                                 "stdlib sources and pydoc topics, held-out files excluded)"))
    print(f"wrote {args.out}: {int(counts.sum())} tokens counted")


if __name__ == "__main__":
    main()
