"""`s2moe convert --to gguf`: write a model as GGUF (llama.cpp names; merged or split experts)."""

from __future__ import annotations

from typing import Optional

import typer

from .common import resolve_model, say
from .errors import cli_errors


def convert(
    out_path: str = typer.Option(..., "--out", "-o", help="Output .gguf file."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder (default: the embedded model)."),
    to: str = typer.Option("gguf", "--to", help="Target format (gguf)."),
    tensor_type: str = typer.Option("F16", "--type", help="F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1."),
    expert_type: Optional[str] = typer.Option(None, "--expert-type", help="Type for expert tensors (default: --type)."),
    split_experts: bool = typer.Option(False, "--split-experts", help="One tensor per (layer, expert, projection)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists (never an input of this run)."),
):
    """Convert a model to GGUF, its tensor data aligned to 4 KiB for direct reads. To requantize the
    file with llama-quantize, add `--override-kv general.alignment=int:32` (it keeps the key, not the
    alignment, and its output is otherwise short)."""
    with cli_errors():
        from ..errors import UsageError
        from ..offload.store import ExpertStore
        from ..model.formats.gguf_writer import write_gguf
        from ..model.loader import load_model
        from ..outputs import check_output

        if to.lower() != "gguf":
            raise UsageError(f"--to {to}: only 'gguf' is supported")
        loaded = load_model(resolve_model(model), dense=False)  # the writer reads one tensor at a time
        check_output(out_path, "--out", inputs=_inputs(loaded), replace=False, force=force)
        if not out_path.endswith(".gguf"):
            say(f"warning: --out {out_path} does not end in .gguf; the file written is GGUF", "yellow")
        store = ExpertStore(loaded)
        write_gguf(loaded, out_path, store.read, tensor_type, expert_type, split_experts, loaded.tokenizer_path)
        say(f"wrote {out_path}")


def _inputs(loaded) -> list[str]:
    """Every file the conversion reads: the model's folder (weights, config, tokenizer) or file."""
    import os

    files = [loaded.path] if os.path.isfile(loaded.path) else \
        [os.path.join(loaded.path, f) for f in os.listdir(loaded.path)]
    return files + ([loaded.tokenizer_path] if loaded.tokenizer_path else [])
