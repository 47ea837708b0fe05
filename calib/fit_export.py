"""`s2moe-calib fit SAMPLES` (refit the cost model from saved samples) and
`s2moe-calib export --format llama-cpp` (the published fork's flags and hot list)."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from s2moe.runtime import jsonfile
from s2moe.runtime.checks import number
from s2moe.runtime.cli.common import print_json, say
from s2moe.runtime.cli.errors import cli_errors

from .update import MIN_PASSES

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

        from .profile_cmd import fit_cost_model, fit_details

        try:
            with open(samples_path) as f:
                data = jsonfile.load(f)
            controlled, decode = data["verification"], data.get("decode_verification") or []
        except FileNotFoundError:
            raise UsageError(f"{samples_path}: samples file not found") from None
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{samples_path}: no 'verification' samples; was it written by s2moe-calib profile?") from None
        check_samples(samples_path, controlled, "verification")
        check_samples(samples_path, decode, "decode_verification")
        if len(controlled) + len(decode) < MIN_PASSES:  # a fit of 4 constants, as `profile --update` asks
            raise UsageError(f"{samples_path}: {len(controlled) + len(decode)} timed passes, at least {MIN_PASSES} are "
                             "needed to fit 4 constants; re-run s2moe-calib profile")
        prof = load_profile(profile_path) if profile_path else None
        if prof is not None:
            same_measurement(data, prof, samples_path)
        model, r2, mape = fit_cost_model(controlled, decode)
        ms = 1e3
        fitted = {"t_base_ms": model.intercept_ * ms, "t_token_ms": model.coef_[0] * ms,
                  "t_exp_miss_ms": model.coef_[1] * ms, "t_exp_hit_ms": model.coef_[2] * ms,
                  "fit": {"r2": round(r2, 5), "mape_percent": round(mape * 100, 3), "n": model.n_samples_,
                          **fit_details(model, "decode passes" if decode else "controlled passes")}}
        for key in ("t_base_ms", "t_token_ms", "t_exp_miss_ms", "t_exp_hit_ms"):
            number(f"{samples_path}: fitted {key}", fitted[key])  # finite, or one line (the samples are degenerate)
        if prof is not None:
            prof.data["cost_model"].update(fitted)
            if prof.data.get("source") == "published":  # its cost model is no longer the published one
                prof.data["source"] = "measured"
                published = prof.data.pop("published", None)
                prof.data["note"] = (f"{prof.data.get('note', '')} Cost model refitted from {os.path.basename(samples_path)}"
                                     f" (published flags were {json.dumps(published)}).").strip()
            prof.data["validation"] = None  # a verdict on the old constants says nothing about these
            save_profile(profile_path, prof.data)
            say(f"updated {profile_path}")
        if json_out:
            print_json(fitted)
        else:
            for k, v in fitted.items():
                print(f"{k}: {v}")


def check_samples(samples_path: str, samples, field: str) -> None:
    """Every timing sample: the cost model's features and its seconds, finite and non-negative."""
    from s2moe.runtime.decoding.pass_log import check_pass_rows

    check_pass_rows(samples_path, samples, field, "; re-run s2moe-calib profile")


def same_measurement(samples: dict, prof, samples_path: str) -> None:
    """Samples go into a profile only when they were measured on its model and device, as --resume
    requires: one line naming the profile, exit 2, otherwise."""
    from s2moe.runtime.errors import UsageError

    fingerprint = samples.get("fingerprint")
    if fingerprint is None and isinstance(samples.get("model"), str) and os.path.exists(samples["model"]):
        from s2moe.runtime.model.loader import load_model
        from s2moe.runtime.profile import model_fingerprint

        fingerprint = model_fingerprint(load_model(samples["model"], dense=False))  # samples of older versions
    model = prof.data["model"]
    if fingerprint is None:
        raise UsageError(f"{samples_path}: records no model fingerprint and its model {samples.get('model')!r} is "
                         f"not there, so it cannot be matched with {prof.path}; re-run s2moe-calib profile")
    if fingerprint != model["fingerprint"]:
        raise UsageError(f"{prof.path}: made for model {model['name']} ({model['fingerprint']}), but "
                         f"{samples_path} was measured on {samples.get('model')} ({fingerprint}); fit into that "
                         "model's profile, or re-run s2moe-calib profile for this one")
    kind = prof.data["device"]["kind"]
    if samples.get("device") not in (None, kind):
        raise UsageError(f"{prof.path}: made for a {kind} device, but {samples_path} was measured on "
                         f"{samples['device']}; fit into that device's profile")


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
    hot_out: Optional[str] = typer.Option(None, "--hot-out", help="Also write the hot list here (the fork's --hot-experts file); nothing is written without it."),
    json_out: bool = typer.Option(False, "--json", help="Print the flags as JSON instead of a command line."),
):
    """Print the published fork's flags for a profile (and write its hot-expert list with --hot-out)."""
    with cli_errors():
        from s2moe.runtime.errors import UsageError
        from s2moe.runtime.profile import load_profile, write_json_atomic

        if fmt != "llama-cpp":
            raise UsageError(f"--format {fmt!r}: only llama-cpp is supported")
        prof = load_profile(profile_path)
        flags = llama_cpp_flags(prof.data)
        hot = prof.hot_experts
        if hot_out is not None:
            if os.path.exists(hot_out) and os.path.samefile(hot_out, profile_path):
                raise UsageError(f"--hot-out {hot_out}: that is the profile being exported; name another file")
            write_json_atomic(hot_out, {"gpu_experts": [list(k) for k in hot]})
        if json_out:
            print_json(flags)
        else:
            print(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))  # plain: no wrapping
        if hot_out is not None:
            say(f"hot list ({len(hot)} experts) written to {hot_out}")
        elif hot:
            say(f"the profile pins {len(hot)} hot experts: add --hot-out FILE to write them for the fork's --hot-experts")
