"""`s2moe-calib validate`: does the profile's cost model predict real S²-MoE verification passes?

Runs S²-MoE (reuse-aware gating on) over the held-out half of the workload at the profile's budget
and residency, with draft caps cycling 1..cap so verification batches of every size occur, and
compares each measured verification pass with the profile's prediction: R², MAPE (%), n and
residual percentiles. Exits 1 below ``--min-r2`` or above ``--max-mape``.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np
import typer
from rich.progress import Progress
from rich.table import Table

from s2moe.runtime.cli.common import err, print_json, resolve_model
from s2moe.runtime.cli.errors import cli_errors


def decode_passes(loaded, prompts: list[list[int]], budget: str | None, hot, spec: dict, costs,
                  emulation: dict | None, tokens: int, progress=None, fetch_threads: int | None = None) -> list:
    """(n_tokens, n_missing, n_resident, seconds) of every verification pass of real S²-MoE decoding
    (reuse-aware gating on) at a budget, draft caps cycling 1..cap so every batch size occurs."""
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.methods import SpecSettings, get_method
    from s2moe.runtime.speculative import SpeculativeDecoder

    emulation = emulation or {}
    engine = build_engine(loaded.path, budget, 4096, hot, emulate_bandwidth=emulation.get("bandwidth_mb_s"),
                          emulate_latency=emulation.get("latency_us") or 0.0, loaded=loaded, fetch_threads=fetch_threads)
    samples = []
    for i, ids in enumerate(prompts):
        settings = SpecSettings(draft_topk=spec["draft_topk"], draft_cap=1 + i % spec["draft_cap"],
                                reuse_cap=spec["reuse_cap"], utility_threshold=0.0, backoff=False)
        dec = SpeculativeDecoder(engine.model, get_method("s2moe"), settings, costs)
        samples.extend(dec.generate(ids, tokens).metrics.verify_samples)
        if progress:
            progress()
    engine.close()
    return samples


def measured_passes(profile, loaded, tok, workload: str | None, n_prompts: int, tokens: int, progress=None) -> list:
    """Verification passes on the held-out half of the workload (profile fits on the other half)."""
    from s2moe.runtime.profile import model_fingerprint

    from .profile_cmd import _workload_tokens

    _, heldout, _ = _workload_tokens(tok, workload)
    same_model = profile.data["model"]["fingerprint"] == model_fingerprint(loaded)
    offload = profile.data.get("offload") or {}
    return decode_passes(loaded, heldout[:n_prompts], profile.budget_spec, profile.hot_experts if same_model else None,
                         profile.speculative, profile.costs, offload.get("emulation"), tokens, progress,
                         offload.get("fetch_threads"))


def evaluate(profile, samples: list) -> dict:
    from s2moe.runtime.cost_model import VerificationCostModel

    c = profile.costs
    model = VerificationCostModel()
    model.intercept_ = c.t_base
    model.coef_ = np.array([c.t_token, c.t_exp_miss, c.t_exp_hit])
    X = np.array([s[:3] for s in samples], dtype=np.float64)
    y = np.array([s[3] for s in samples])
    resid = (y - model.predict(X)) / y
    return {
        "r2": round(model.score(X, y), 5), "mape_percent": round(model.mape(X, y) * 100, 3), "n": len(samples),
        "residual_percent_p50": round(float(np.percentile(resid, 50)) * 100, 3),
        "residual_percent_p90_abs": round(float(np.percentile(np.abs(resid), 90)) * 100, 3),
        "measured_ms_range": [round(float(y.min()) * 1e3, 4), round(float(y.max()) * 1e3, 4)],
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
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model (default: the embedded model)."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="JSONL prompts (default: the packaged set)."),
    n_prompts: int = typer.Option(16, "--n-prompts", min=1, help="Held-out prompts to decode."),
    tokens: int = typer.Option(32, "--max-tokens", "-n", min=2, help="Tokens per prompt."),
    min_r2: float = typer.Option(0.95, "--min-r2", help="Exit 1 below this R²."),
    max_mape: float = typer.Option(5.0, "--max-mape", help="Exit 1 above this MAPE, in percent."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write predicted-vs-measured PNG here."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (r2, mape_percent, n, …)."),
):
    """Check the profile's verification-cost model against measured S²-MoE passes."""
    with cli_errors():
        from s2moe.runtime.loader import load_model
        from s2moe.runtime.profile import load_profile
        from s2moe.runtime.tokenizer import load_tokenizer

        prof = load_profile(profile_path)
        loaded = load_model(resolve_model(model))
        tok = load_tokenizer(loaded)
        with Progress(console=err, transient=True) as p:
            task = p.add_task("validation passes", total=n_prompts)
            samples = measured_passes(prof, loaded, tok, workload, n_prompts, tokens, lambda: p.advance(task))
        if len(samples) < 3:
            from s2moe.runtime.errors import UsageError

            raise UsageError("too few verification passes to validate; raise --n-prompts or --max-tokens")
        result = evaluate(prof, samples)
        if plot_path:
            plot(result, plot_path)
        ok = result["r2"] >= min_r2 and result["mape_percent"] <= max_mape
        summary = {k: v for k, v in result.items() if k not in ("predicted", "measured")}
        summary.update(profile=profile_path, passed=ok, min_r2=min_r2, max_mape_percent=max_mape)
        if json_out:
            print_json(summary)
        else:
            t = Table(title=f"validation of {profile_path}")
            t.add_column("metric")
            t.add_column("value", justify="right")
            for k in ("r2", "mape_percent", "n", "residual_percent_p50", "residual_percent_p90_abs", "measured_ms_range"):
                t.add_row(k, str(summary[k]))
            t.add_row("verdict", "[green]pass[/green]" if ok else "[red]fail[/red]")
            err.print(t)
        if not ok:
            print(f"validation failed: R² {result['r2']} (min {min_r2}), MAPE {result['mape_percent']} % "
                  f"(max {max_mape} %); re-run s2moe-calib profile", file=sys.stderr)
            raise typer.Exit(1)
