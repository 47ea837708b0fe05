"""`s2moe vocab`: rank a model's tokens by how often a corpus uses them (for `--draft-vocab`)."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from .common import err, print_json, resolve_model, say
from .errors import cli_errors

SHARES = (1 / 16, 1 / 8, 1 / 4, 1 / 2)  # draft-head sizes whose coverage the table shows


def _texts(paths: list[str]):
    """Each corpus file's text: plain UTF-8, or a JSONL prompt set (its prompts, as `bench` reads them)."""
    from ..errors import UsageError
    from ..prompts import load_workload

    for path in paths:
        if path.endswith(".jsonl"):
            yield from load_workload(path)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except FileNotFoundError:
            raise UsageError(f"--corpus {path}: file not found") from None
        except IsADirectoryError:
            raise UsageError(f"--corpus {path}: is a folder; pass its text files") from None
        except UnicodeDecodeError:
            raise UsageError(f"--corpus {path}: not UTF-8 text; convert it or pass another file") from None


def vocab(
    corpus: List[str] = typer.Option(..., "--corpus", help="UTF-8 text file, or a .jsonl prompt set; repeat the flag for several."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json (or its folder) to use instead of the model's."),
    out_path: Optional[str] = typer.Option(None, "--out", "-o", help="Ranks file to write (default: token_ranks.json beside the model)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing ranks file."),
    json_out: bool = typer.Option(False, "--json", help="Print the coverage summary as JSON on stdout."),
):
    """Count token ids in a corpus and write the ranks file `--draft-vocab N` reads (FR-Spec)."""
    with cli_errors():
        from ..model.draft_head import count_tokens, default_ranks_path, ranks_document, write_ranks
        from ..model.loader import load_model
        from ..model.tokenizer import load_tokenizer
        from ..outputs import check_output

        loaded = load_model(resolve_model(model), dense=False)
        path = check_output(out_path or default_ranks_path(loaded.path), "--out", inputs=corpus, replace=False,
                            force=force)
        tok = load_tokenizer(loaded, tokenizer)
        V = loaded.config.vocab_size
        with err.status("counting tokens"):
            counts = count_tokens(lambda text: tok.encode(text).ids, _texts(corpus), V)
        if counts.sum() == 0:
            from ..errors import UsageError

            raise UsageError(f"--corpus {', '.join(corpus)}: no tokens to count; pass text the model reads")
        document = ranks_document(counts, source=", ".join(corpus))
        write_ranks(path, document)
        ordered = counts[document["ranked_ids"]]
        rows = [{"draft_vocab": n, "share_of_vocab": round(n / V, 4),
                 "coverage": round(float(ordered[:n].sum() / counts.sum()), 4)} for n in (max(1, int(V * s)) for s in SHARES)]
        summary = {"path": path, "vocab_size": V, "tokens_counted": int(counts.sum()),
                   "tokens_seen": len(document["ranked_ids"]), "coverage": rows}
        if json_out:
            print_json(summary)
            return
        table = Table(title=f"{path}: {summary['tokens_counted']} tokens counted, {summary['tokens_seen']} of {V} seen")
        for col in ("--draft-vocab", "share of the vocabulary", "corpus tokens inside"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(str(r["draft_vocab"]), f"{r['share_of_vocab']:.1%}", f"{r['coverage']:.1%}")
        err.print(table)
        say(f"wrote {path}; use it with s2moe run --draft-vocab N", "dim")
