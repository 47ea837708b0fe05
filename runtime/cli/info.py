"""`s2moe info`: architecture, sizes and bytes per expert of a model (table or JSON)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from .common import out, print_json, resolve_model
from .errors import cli_errors


def _router(c) -> str:
    text = c.router
    if c.norm_topk_prob and c.router != "topk_softmax":
        text += " (renormalised)"
    if c.expert_groups:
        text += f", best {c.expert_groups_used} of {c.expert_groups} groups"
    if c.routed_scaling_factor != 1.0:
        text += f", weights × {c.routed_scaling_factor:g}"
    return text


def _attention(c) -> str:
    text = c.attention
    if c.sliding_window:
        layers = sum(c.sliding_layers) if c.sliding_layers else c.num_layers
        text += f", window {c.sliding_window} on {layers} of {c.num_layers} layers"
    return text + (", sinks" if c.attention_sinks else "")


def describe(loaded) -> dict:
    c = loaded.config
    any_expert = next(iter(loaded.experts.values()))
    shared = sum(a.nbytes for k, a in loaded.dense.items() if k.split(".")[-1].startswith("shared_"))
    return {
        "path": loaded.path,
        "format": loaded.format,
        "expert_layout": loaded.expert_layout,
        "architecture": c.arch,
        "attention": _attention(c),
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
        "router": _router(c),
        "expert_activation": c.expert_act + (" with biases" if c.expert_bias else ""),
        "expert_storage_type": any_expert.storage_type,
        "expert_bytes_stored": any_expert.stored_bytes,
        "expert_bytes_resident": any_expert.resident_bytes,
        "experts_total": len(loaded.experts),
        "expert_bytes_stored_total": loaded.expert_stored_bytes,
        "expert_bytes_resident_total": loaded.expert_resident_bytes,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "shared_expert_bytes_resident": shared,  # part of the dense bytes: never offloaded
        "kv_bytes_per_position": c.kv_floats_per_position * 4,
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
        from ..model.loader import load_model

        facts = describe(load_model(resolve_model(model)))
        if json_out:
            print_json(facts)
            return
        table = Table(title="model", show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        for key, value in facts.items():
            shown = _fmt_bytes(value) + f" ({value:,})" if "bytes" in key and value is not None else str(value)
            table.add_row(key, shown)
        out.print(table)
