"""`s2moe-calib validate`: does the profile's cost model predict real S²-MoE verification passes?

Runs S²-MoE (reuse-aware gating on) over the held-out half of the workload at the profile's budget
and residency, with draft caps cycling 1..cap so verification batches of every size occur, and
compares each measured verification pass with the profile's prediction: R², MAPE (%), n and
residual percentiles. Exits 1 below ``--min-r2`` or above ``--max-mape``.

The model is the profile's own (``model.path``) unless ``--model`` names another; a model whose
fingerprint differs from the profile's is validated with a one-line warning (and without the
profile's hot list). The result is recorded in the profile's ``validation`` field (atomically)
when the model is the profile's.

A pass's measured time is the fastest of ``--rounds`` interleaved replays of it from its own cache
state and KV context (`replay`); the single-shot figures of the original passes are reported too.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional

import numpy as np
import typer
from rich.progress import Progress
from rich.table import Table

from s2moe.runtime.checks import expert_pairs, number
from s2moe.runtime.cli.common import err, print_json, resolve_model, say
from s2moe.runtime.cli.errors import cli_errors
from s2moe.runtime.errors import UsageError

from . import plan as plan_mod

from .passes import decode_passes
from .replay import DEFAULT_ROUNDS, WeightPool, replay, single_shot_samples, spread


def measured_passes(profile, loaded, tok, workload: str | None, n_prompts: int, tokens: int, rounds: int,
                    progress=None) -> list:
    """Verification passes on the held-out half of the workload (profile fits on the other half)."""
    from .profile_cmd import _workload_tokens

    _, heldout, _ = _workload_tokens(tok, workload)
    from s2moe.runtime.engine import engine_tier

    from .profile_cmd import profile_backend

    same_model = same_model_as(profile, loaded)
    where = profile.path or "profile"
    ctx = plan_mod.profile_context(profile.data, where)
    draft_cap = profile.speculative["draft_cap"]
    offload, device = profile.data.get("offload") or {}, profile.data["device"]
    arrays = profile_backend(device.get("backend") or "numpy", device["kind"])  # as the profile was measured
    pool = WeightPool()
    hot = expert_pairs(profile.hot_experts, loaded.config, f"{where}: hot_experts.gpu_experts") if same_model else None
    with decode_passes(loaded, heldout[:n_prompts], profile.budget_spec, hot,
                       profile.speculative, profile.costs, offload.get("emulation"), tokens, pool, progress,
                       offload.get("fetch_threads"), arrays, engine_tier(device["offload_tier"]),
                       kv_positions=plan_mod.kv_positions(ctx, draft_cap), batch=plan_mod.batch(ctx, draft_cap),
                       budget_from=f"{where}: budget.spec") as passes:
        task = progress.add_task(f"replays ({rounds} rounds)", total=rounds * len(passes)) if progress else None
        replay(passes, pool, rounds, (lambda: progress.advance(task)) if progress else (lambda: None))
    return passes


def same_model_as(profile, loaded) -> bool:
    from s2moe.runtime.profile import model_fingerprint

    return profile.data["model"]["fingerprint"] == model_fingerprint(loaded)


def model_for(prof, model: str | None) -> str:
    """--model as given, else the model the profile was made with (``model.path``), else (presets,
    older profiles) the embedded model."""
    if model:
        path = resolve_model(model)
        if not os.path.exists(path):
            raise UsageError(f"--model {model}: no such file or folder; pass an HF folder or a .gguf file")
        return path
    recorded = prof.data["model"].get("path")
    if recorded is None:
        return resolve_model(None)
    if not isinstance(recorded, str) or not os.path.exists(recorded):
        raise UsageError(f"{prof.path}: model.path {recorded!r} (the profile's model) is not there; "
                         "pass --model PATH")
    return recorded


def workload_for(prof, workload: str | None) -> str | None:
    """--workload as given, else the one the profile was made with (its held-out half), if it is still there."""
    if workload:
        return workload
    recorded = (prof.data.get("provenance") or {}).get("workload")
    return recorded if isinstance(recorded, str) and os.path.isfile(recorded) else None


def record(prof, summary: dict, model_path: str, workload: str | None) -> None:
    """The verdict into the profile's ``validation`` field (atomic write); a profile that cannot be
    written (read-only) keeps its old field, with a one-line note."""
    from s2moe import __version__
    from s2moe.runtime.profile import save_profile

    prof.data["validation"] = {
        "r2": summary["r2"], "mape_percent": summary["mape_percent"], "n": summary["n"],
        "passed": summary["passed"], "min_r2": summary["min_r2"], "max_mape_percent": summary["max_mape_percent"],
        "single_shot": summary["single_shot"], "rounds": summary["timing"].get("rounds"),
        "noise_ceiling_r2": summary["timing"].get("noise_ceiling_r2"),
        "model": os.path.abspath(model_path), "workload": workload or "packaged",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
    }
    try:
        save_profile(prof.path, prof.data)
    except OSError as exc:
        say(f"note: could not record the result in {prof.path} ({exc.strerror or exc}); the verdict stands", "yellow")
        return
    say(f"recorded in {prof.path} (field validation)", "dim")


def evaluate(profile, samples: list) -> dict:
    """Predictions of the profile's cost model against the measured seconds."""
    from s2moe.runtime.decoding.cost_model import VerificationCostModel

    c = profile.costs
    model = VerificationCostModel()
    model.intercept_ = c.t_base
    model.coef_ = np.array([c.t_token, c.t_exp_miss, c.t_exp_hit])
    X = np.array([[s["n_tokens"], s["n_missing"], s["n_resident"]] for s in samples], dtype=np.float64)
    y = np.array([s["seconds"] for s in samples])
    resid = (y - model.predict(X)) / y
    # the same model on a machine that got uniformly faster or slower since `profile` (one speed
    # factor, the median measured / predicted): what is left is the model's error, not the drift
    scale = float(np.median(y / np.maximum(model.predict(X), 1e-12)))
    drifted = VerificationCostModel()
    drifted.intercept_, drifted.coef_ = model.intercept_ * scale, model.coef_ * scale
    return {
        "r2": round(model.score(X, y), 5), "mape_percent": round(model.mape(X, y) * 100, 3), "n": len(samples),
        "residual_percent_p50": round(float(np.percentile(resid, 50)) * 100, 3),
        "residual_percent_p90_abs": round(float(np.percentile(np.abs(resid), 90)) * 100, 3),
        "measured_ms_range": [round(float(y.min()) * 1e3, 4), round(float(y.max()) * 1e3, 4)],
        "drift_adjusted": {"speed_factor": round(scale, 4), "r2": round(drifted.score(X, y), 5),
                           "mape_percent": round(drifted.mape(X, y) * 100, 3)},
        "predicted": model.predict(X).tolist(), "measured": y.tolist(),
    }


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from s2moe.runtime.errors import UsageError

        raise UsageError("--plot needs matplotlib: pip install 's2moe[plot]'") from None
    pred = np.array(result["predicted"]) * 1e3
    meas = np.array(result["measured"]) * 1e3
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(meas, pred, s=10, alpha=0.6)
    lo, hi = min(meas.min(), pred.min()), max(meas.max(), pred.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax.set_xlabel("measured verification ms")
    ax.set_ylabel("predicted ms")
    ax.set_title(f"R² {result['r2']:.3f} · MAPE {result['mape_percent']:.2f} % · n {result['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def validate(
    profile_path: str = typer.Option(..., "--profile", "-p", help="Profile to validate."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model (default: the profile's model)."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="JSONL prompts (default: the profile's workload, else the packaged set)."),
    n_prompts: int = typer.Option(16, "--n-prompts", help="Held-out prompts to decode (at least 1)."),
    tokens: int = typer.Option(32, "--max-tokens", "-n", help="Tokens per prompt (at least 2)."),
    rounds: int = typer.Option(DEFAULT_ROUNDS, "--rounds",
                               help="Interleaved replays per pass; its time is the fastest (1 = single shot)."),
    min_r2: float = typer.Option(0.95, "--min-r2", help="Exit 1 below this R²."),
    max_mape: float = typer.Option(5.0, "--max-mape", help="Exit 1 above this MAPE, in percent."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write predicted-vs-measured PNG here."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (r2, mape_percent, n, …)."),
):
    """Check the profile's verification-cost model against measured S²-MoE passes."""
    with cli_errors():
        from s2moe.runtime.model.loader import load_model
        from s2moe.runtime.profile import load_profile
        from s2moe.runtime.model.tokenizer import load_tokenizer

        from .profile_cmd import check_counts

        check_counts(**{"--n-prompts": (n_prompts, 1), "--max-tokens": (tokens, 2), "--rounds": (rounds, 1)})
        number("--min-r2", min_r2)
        number("--max-mape", max_mape, low=0)
        prof = load_profile(profile_path)
        model_path = model_for(prof, model)
        workload = workload_for(prof, workload)
        loaded = load_model(model_path)
        same = same_model_as(prof, loaded)
        if not same:
            say(f"warning: {profile_path} was made for model {prof.data['model']['name']} (fingerprint "
                f"{prof.data['model']['fingerprint']}), not {model_path}: validating its cost model on this model, "
                "without its hot list; the result is not recorded in the profile", "yellow")
        tok = load_tokenizer(loaded)
        with Progress(console=err, transient=True) as p:
            passes = measured_passes(prof, loaded, tok, workload, n_prompts, tokens, rounds, p)
        samples = [q.sample() for q in passes]
        if len(samples) < 3:
            raise UsageError("too few verification passes to validate; raise --n-prompts or --max-tokens")
        result = evaluate(prof, samples)
        if plot_path:
            plot(result, plot_path)
        ok = result["r2"] >= min_r2 and result["mape_percent"] <= max_mape
        summary = {k: v for k, v in result.items() if k not in ("predicted", "measured")}
        single = evaluate(prof, single_shot_samples(passes))
        summary.update(profile=profile_path, passed=ok, min_r2=min_r2, max_mape_percent=max_mape,
                       timing={"estimator": "fastest of interleaved replays", **spread(passes)},
                       single_shot={"r2": single["r2"], "mape_percent": single["mape_percent"]})
        if same:
            record(prof, summary, model_path, workload)
        if json_out:
            print_json(summary)
        else:
            t = Table(title=f"validation of {profile_path}")
            t.add_column("metric")
            t.add_column("value", justify="right")
            for k in ("r2", "mape_percent", "n", "residual_percent_p50", "residual_percent_p90_abs", "measured_ms_range"):
                t.add_row(k, str(summary[k]))
            t.add_row("timing", f"fastest of {rounds} replays (repeat CV {summary['timing']['repeat_cv_median']})")
            t.add_row("noise ceiling R² / MAPE floor %", f"{summary['timing']['noise_ceiling_r2']} / "
                                                          f"{summary['timing']['noise_mape_floor_percent']}")
            d = summary["drift_adjusted"]
            t.add_row("drift-adjusted R² / MAPE %", f"{d['r2']} / {d['mape_percent']} (machine ×{d['speed_factor']} "
                                                   "since profile)")
            t.add_row("single shot R² / MAPE %", f"{single['r2']} / {single['mape_percent']}")
            t.add_row("verdict", "[green]pass[/green]" if ok else "[red]fail[/red]")
            err.print(t)
        if not ok:
            print(f"validation failed: R² {result['r2']} (min {min_r2}), MAPE {result['mape_percent']} % "
                  f"(max {max_mape} %); re-run s2moe-calib profile", file=sys.stderr)
            raise typer.Exit(1)
