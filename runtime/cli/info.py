"""`s2moe info`: architecture, sizes and bytes per expert of a model (table or JSON)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from .common import out, print_json, resolve_model
from .errors import cli_errors


def describe(loaded) -> dict:
    c = loaded.config
    any_expert = next(iter(loaded.experts.values()))
    return {
        "path": loaded.path,
        "format": loaded.format,
        "expert_layout": loaded.expert_layout,
        "architecture": c.arch,
        "layers": c.num_layers,
        "moe_layers": len(c.moe_layer_ids),
        "hidden_size": c.hidden_size,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "experts_per_layer": c.num_experts,
        "top_k": c.top_k,
        "expert_intermediate_size": c.expert_intermediate_size,
        "router": c.router + (" (renormalised)" if c.norm_topk_prob and c.router == "softmax_topk" else ""),
        "expert_storage_type": any_expert.gate.dtype,
        "expert_bytes_stored": any_expert.stored_bytes,
        "expert_bytes_resident": any_expert.resident_bytes,
        "experts_total": len(loaded.experts),
        "expert_bytes_stored_total": loaded.expert_stored_bytes,
        "expert_bytes_resident_total": loaded.expert_resident_bytes,
        "dense_bytes_resident": loaded.dense_bytes,
        "total_bytes_resident": loaded.dense_bytes + loaded.expert_resident_bytes,
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def info(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Show a model's architecture, layer/expert counts and byte sizes."""
    with cli_errors():
        from ..loader import load_model

        facts = describe(load_model(resolve_model(model)))
        if json_out:
            print_json(facts)
            return
        table = Table(title="model", show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        for key, value in facts.items():
            shown = _fmt_bytes(value) + f" ({value:,})" if "bytes" in key else str(value)
            table.add_row(key, shown)
        out.print(table)
