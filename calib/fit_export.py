"""`s2moe-calib fit SAMPLES` (refit the cost model from saved samples) and
`s2moe-calib export --format llama-cpp` (the published fork's flags and hot list)."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from s2moe.runtime.cli.common import print_json, say
from s2moe.runtime.cli.errors import cli_errors

MIB = 1 << 20


def fit(
    samples_path: str = typer.Argument(..., help="A NAME.samples.json written by s2moe-calib profile."),
    profile_path: Optional[str] = typer.Option(None, "--profile", "-p", help="Update this profile's cost model (atomic)."),
    json_out: bool = typer.Option(False, "--json", help="Print the fitted constants as JSON."),
):
    """Refit the verification-cost model from saved timing samples."""
    with cli_errors():
        from s2moe.runtime.errors import UsageError
        from s2moe.runtime.profile import load_profile, save_profile

        from .profile_cmd import fit_cost_model

        try:
            with open(samples_path) as f:
                data = json.load(f)
            controlled, decode = data["verification"], data.get("decode_verification") or []
        except FileNotFoundError:
            raise UsageError(f"{samples_path}: samples file not found") from None
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{samples_path}: no 'verification' samples; was it written by s2moe-calib profile?") from None
        model, r2, mape = fit_cost_model(controlled, decode)
        ms = 1e3
        fitted = {"t_base_ms": model.intercept_ * ms, "t_token_ms": model.coef_[0] * ms,
                  "t_exp_miss_ms": model.coef_[1] * ms, "t_exp_hit_ms": model.coef_[2] * ms,
                  "fit": {"r2": round(r2, 5), "mape_percent": round(mape * 100, 3), "n": model.n_samples_}}
        if profile_path:
            prof = load_profile(profile_path)
            prof.data["cost_model"].update(fitted)
            save_profile(profile_path, prof.data)
            say(f"updated {profile_path}")
        if json_out:
            print_json(fitted)
        else:
            for k, v in fitted.items():
                print(f"{k}: {v}")


def llama_cpp_flags(profile: dict) -> dict:
    """The published fork's flags. Presets carry the published values verbatim; measured profiles
    keep the true expert size and set the bandwidth so that MiB / (MiB/ms) = the fitted T_exp miss."""
    if "published" in profile:
        return dict(profile["published"])
    c, m, s = profile["cost_model"], profile["model"], profile["speculative"]
    mib = m["expert_bytes_stored"] / MIB
    t_exp = c["t_exp_miss_ms"] or 1e-9
    return {"prune_tpot": round(c["t_ar_ms"], 4), "prune_eps": round(c["c_draft_ms"], 4),
            "prune_expert_bytes": round(mib, 6), "prune_bandwidth": round(mib / t_exp, 6),
            "draft_expert_topk": s["draft_topk"], "moe_reuse_expert_cap": s["reuse_cap"], "draft": s["draft_cap"]}


def export(
    profile_path: str = typer.Option(..., "--profile", "-p", help="Profile to export."),
    fmt: str = typer.Option("llama-cpp", "--format", help="llama-cpp (the published S²-MoE fork)."),
    hot_out: Optional[str] = typer.Option(None, "--hot-out", help="Where to write the hot list (default: PROFILE.hot.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print the flags as JSON instead of a command line."),
):
    """Print the published fork's flags for a profile and write its hot-expert list."""
    with cli_errors():
        from s2moe.runtime.errors import UsageError
        from s2moe.runtime.profile import load_profile, write_json_atomic

        if fmt != "llama-cpp":
            raise UsageError(f"--format {fmt!r}: only llama-cpp is supported")
        prof = load_profile(profile_path)
        flags = llama_cpp_flags(prof.data)
        hot = prof.hot_experts
        target = hot_out or os.path.splitext(profile_path)[0] + ".hot.json"
        write_json_atomic(target, {"gpu_experts": [list(k) for k in hot]})
        if json_out:
            print_json(flags)
        else:
            print(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))  # plain: no wrapping
        say(f"hot list ({len(hot)} experts) written to {target}")
