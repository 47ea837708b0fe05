"""`s2moe info`: architecture, sizes and bytes per expert of a model (table or JSON)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from .common import out, print_json, resolve_model
from .errors import cli_errors
from ..model.kv_cache import kv_bytes_per_position


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


def describe(loaded, cache_type: str = "f32") -> dict:
    c = loaded.config
    any_expert = next(iter(loaded.experts.values()))
    shared = sum(s.resident_bytes() for k, s in loaded.dense_specs.items() if k.split(".")[-1].startswith("shared_"))
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
        "kv_bytes_per_position": kv_bytes_per_position(c, cache_type),
        "dense_bytes_stored": loaded.dense_stored_bytes,
        "dense_bytes_resident": loaded.dense_bytes,
        "context_length": c.max_position_embeddings,
        "total_bytes_resident": loaded.dense_bytes + loaded.expert_resident_bytes,
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def memory_plan(loaded, budget, expert_budget, positions: int, kernels: str = "auto", cache_type: str = "auto") -> dict:
    """The plan a run with these settings would make (nothing is loaded to make it)."""
    from ..kernels import select_ops
    from ..model.kv_cache import resolve_cache_type
    from ..offload.memory import Budget, plan_memory

    ops = select_ops(kernels)
    cache_type = resolve_cache_type(cache_type, loaded.config)
    plan = plan_memory(loaded, Budget.parse(budget),
                       positions, Budget.parse(expert_budget, "--expert-budget") if expert_budget else None,
                       reference_kernels=ops.name == "numpy", cache_type=cache_type)
    return {"budget": budget or "full", "kv_positions": positions, "kv_cache_type": cache_type, "kernels": ops.name,
            **plan.to_dict()}


# What a device's memory keeps for others, by assumption (no Orin has been measured here): on unified
# memory (Jetson) the OS, the CUDA context and the Python process share the DRAM with the model;
# on a discrete GPU the CUDA context and cuBLAS's workspace take device memory
RESERVE_UNIFIED = 5 << 29  # 2.5 GiB
RESERVE_DISCRETE = 3 << 28  # 0.75 GiB


def _device_profile(device: str) -> tuple[str, dict]:
    """(name, the profile's device section) of a preset in profiles/ or a profile JSON path."""
    import json
    import os

    from ..errors import UsageError

    presets = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "profiles")
    known = sorted(f[:-5] for f in os.listdir(presets) if f.endswith(".json") and f != "schema.json") \
        if os.path.isdir(presets) else []
    path = device if device.endswith(".json") else os.path.join(presets, device + ".json")
    if not os.path.isfile(path):
        raise UsageError(f"--device {device!r}: no such preset or profile; choose from {', '.join(known)} "
                         "or give a profile .json")
    try:
        with open(path, encoding="utf-8") as fh:
            section = json.load(fh)["device"]
        int(section["memory_bytes"]), section["kind"]
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"--device {path}: not a profile with a device.memory_bytes and device.kind; "
                         "make one with s2moe-calib profile") from None
    return os.path.basename(path)[:-5], section


def device_plan(loaded, device: str, positions: int, cache_type: str = "f16") -> dict:
    """The memory plan of this model on ``device``: its memory less what the system keeps, as the
    budget, experts held at their stored bytes by the device kernels; and the plan in one line."""
    from ..errors import UsageError
    from ..offload.memory import Budget, plan_memory

    name, d = _device_profile(device)
    unified = d["kind"] == "orin"
    memory = int(d["memory_bytes"])
    reserve = RESERVE_UNIFIED if unified else RESERVE_DISCRETE
    budget = memory - reserve
    f = _fmt_bytes
    whole = plan_memory(loaded, Budget.parse("1.0"), positions, baseline=0, cache_type=cache_type)
    rest = whole.dense_bytes + whole.kv_bytes + whole.work_bytes
    if rest > budget:
        raise UsageError(f"--device {name}: {f(budget)} for the model is less than its dense part, KV and "
                         f"workspace ({f(rest)}); use a smaller --ctx-size or a device with more memory")
    plan = plan_memory(loaded, Budget.parse(f"{budget >> 20}m"), positions, baseline=0, cache_type=cache_type)
    tier = "the file (NVMe: unified memory has no host tier)" if unified else \
        ("pinned host memory" if d.get("offload_tier") == "host" else "the file")
    streams = (f"the other experts stream from {tier}" if plan.expert_share < 1 else "every expert resident")
    line = (f"{name} ({d.get('name', d['kind'])}, {f(memory)} {'unified' if unified else 'device'} memory, "
            f"{f(budget)} for the model): dense {f(plan.dense_bytes)} + experts {f(plan.expert_capacity)} "
            f"({plan.expert_share:.0%} resident) + KV {f(plan.kv_bytes)} ({positions} {cache_type} positions) "
            f"+ workspace {f(plan.work_bytes)} = {f(plan.model_bytes)}; {streams}")
    return {"device": name, "device_name": d.get("name"), "unified_memory": unified, "memory_bytes": memory,
            "reserved_bytes": reserve, "kv_positions": positions, "kv_cache_type": cache_type,
            "offload_tier": tier, "fits": plan.model_bytes <= budget, **plan.to_dict(), "line": line}


def info(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="HF folder or .gguf file (default: the embedded model)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Show the memory plan for this budget (16g, 512m, 0.25)."),
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", help="… and this expert budget."),
    ctx: Optional[int] = typer.Option(None, "--ctx-size", min=1, help="KV positions to plan for (default: the model's context, at most 4096)."),
    cache_type: str = typer.Option("auto", "--cache-type", help="KV cache type to plan: f32, f16 or q8_0 (auto: f16)."),
    device: Optional[str] = typer.Option(None, "--device", help="Plan for a device: a preset (orin-16g, orin-32g, orin-64g, rtx4090) or a profile .json; shows dense, resident experts, KV and workspace in one line."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Show a model's architecture, layer/expert counts, byte sizes and memory plan."""
    with cli_errors():
        from ..model.loader import load_model

        loaded = load_model(resolve_model(model), dense=False)  # sizes come from the index: nothing read
        from ..model.kv_cache import resolve_cache_type

        cache_type = resolve_cache_type(cache_type, loaded.config)
        facts = describe(loaded, cache_type)
        facts["kv_cache_type"] = cache_type
        positions = ctx or min(loaded.config.max_position_embeddings or 4096, 4096)
        facts["memory_plan"] = memory_plan(loaded, budget, expert_budget, positions, cache_type=cache_type)
        if device:
            facts["device_plan"] = device_plan(loaded, device, positions, cache_type)
        if json_out:
            print_json(facts)
            return
        if device:
            out.print(facts["device_plan"]["line"], soft_wrap=True)
        table = Table(title="model", show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value")
        for key, value in facts.items():
            if isinstance(value, dict):
                continue
            shown = _fmt_bytes(value) + f" ({value:,})" if "bytes" in key and value is not None else str(value)
            table.add_row(key, shown)
        plan = facts["memory_plan"]
        for key, value in plan.items():
            if key == "workspace":
                value = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in value.items() if v)
            elif "bytes" in key:
                value = _fmt_bytes(value) + f" ({value:,})"
            table.add_row("plan." + key, str(value))
        out.print(table)
