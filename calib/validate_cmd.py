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
The raw figures are the result. The speed probe (`speed_probe`), timed in the same rounds here and
in profile, tells drift from model error; figures adjusted by its ratio appear only where it moved.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
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
from . import speed_probe

from .passes import decode_passes
from .replay import DEFAULT_ROUNDS, WeightPool, replay, single_shot_samples, spread


def measured_passes(profile, loaded, tok, workload: str | None, n_prompts: int, tokens: int, rounds: int,
                    progress=None) -> tuple[list, dict | None]:
    """Verification passes on the held-out half of the workload (profile fits on the other half),
    and the speed probe's time, taken in the same rounds (`speed_probe`)."""
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
                       budget_from=f"{where}: budget.spec") as (passes, engine_model):
        probes = speed_probe.reference_passes(engine_model, pool)
        timed = passes + speed_probe.every_pass(probes)
        task = progress.add_task(f"replays ({rounds} rounds)", total=rounds * len(timed)) if progress else None
        replay(timed, pool, rounds, (lambda: progress.advance(task)) if progress else (lambda: None))
    return passes, speed_probe.summarize(probes)


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
        "residual_percent_p50": summary["residual_percent_p50"], "fit_ratio": summary["fit_ratio"],
        "probe_ratio": summary["probe"]["ratio"], "probe_verdict": summary["probe"]["verdict"],
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


# where validate's passes differ from each other in what the cost model sees: a bias confined to
# one group names the term the model misses (a per-pass cost shows in small batches, a read cost
# in passes with misses)
GROUPS = {"batch": (("1 token", 1, 1), ("2-4 tokens", 2, 4), ("5+ tokens", 5, None)),
          "misses": (("no misses", 0, 0), ("1-8 misses", 1, 8), ("9+ misses", 9, None))}
GROUP_FEATURE = {"batch": "n_tokens", "misses": "n_missing"}


def bias_by_group(samples: list, resid: np.ndarray) -> list[dict]:
    """Median residual (measured / predicted − 1, %) and n per group of `GROUPS`."""
    rows = []
    for kind, groups in GROUPS.items():
        values = np.array([s[GROUP_FEATURE[kind]] for s in samples])
        for name, lo, hi in groups:
            sel = (values >= lo) & (values <= (hi if hi is not None else np.inf))
            if sel.any():
                rows.append({"group": name, "n": int(sel.sum()),
                             "median_residual_percent": round(float(np.median(resid[sel])) * 100, 2)})
    return rows


def evaluate(profile, samples: list, drift=None, drift_label: float | None = None) -> dict:
    """Predictions of the profile's cost model against the measured seconds: the raw figures, the
    bias per group, and, given the drift the speed probe expects (per pass, or one ratio; only
    where it saw drift), the model scaled by it (labelled with ``drift_label``, the median)."""
    from s2moe.runtime.decoding.cost_model import VerificationCostModel, mape, r2

    model = VerificationCostModel.from_constants(profile.costs)
    X = np.array([[s["n_tokens"], s["n_missing"], s["n_resident"]] for s in samples], dtype=np.float64)
    y = np.array([s["seconds"] for s in samples])
    predicted = model.predict(X)
    ratio = y / np.maximum(predicted, 1e-12)
    out = {
        "r2": round(r2(y, predicted), 5), "mape_percent": round(mape(y, predicted) * 100, 3), "n": len(samples),
        "residual_percent_p50": round(float(np.median(ratio - 1)) * 100, 3),
        "residual_percent_p90_abs": round(float(np.percentile(np.abs(y - predicted) / y, 90)) * 100, 3),
        "measured_ms_range": [round(float(y.min()) * 1e3, 4), round(float(y.max()) * 1e3, 4)],
        "fit_ratio": round(float(np.median(ratio)), 4),  # measured / predicted
        "bias_by_group": bias_by_group(samples, ratio - 1),
        "predicted": predicted.tolist(), "measured": y.tolist(),
    }
    if drift is not None:
        adjusted = predicted * np.asarray(drift, dtype=np.float64)
        label = float(np.median(drift)) if drift_label is None else drift_label
        out["drift_adjusted"] = {"probe_ratio": round(label, 4), "r2": round(r2(y, adjusted), 5),
                                 "mape_percent": round(mape(y, adjusted) * 100, 3)}
    return out


def _pyplot():
    """matplotlib's pyplot (Agg), or the one-line error: asked before the run, not after it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from s2moe.runtime.errors import UsageError

        raise UsageError("--plot needs matplotlib: pip install 's2moe[plot]'") from None
    return plt


def plot(result: dict, path: str) -> None:
    plt = _pyplot()
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
    min_r2: Optional[float] = typer.Option(None, "--min-r2", help="Exit 1 below this R² (default: 0.95, or the run's noise ceiling less 0.05 where that is lower: no model beats the noise)."),
    max_mape: Optional[float] = typer.Option(None, "--max-mape", help="Exit 1 above this MAPE, in percent (default: 5, or 1.5x the run's noise MAPE floor where that is higher)."),
    max_bias: float = typer.Option(5.0, "--max-bias", help="Exit 1 when the median residual (measured / predicted − 1) is beyond ± this, in percent."),
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
        if min_r2 is not None:
            number("--min-r2", min_r2)
        if max_mape is not None:
            number("--max-mape", max_mape, low=0)
        number("--max-bias", max_bias, low=0)
        if plot_path:
            _pyplot()  # a missing matplotlib fails now, not after minutes of decoding
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
            summary, result = run_validation(prof, loaded, tok, workload, n_prompts, tokens, rounds,
                                             Bars(min_r2, max_mape, max_bias), same, p)
        summary["profile"] = profile_path
        if plot_path:
            plot(result, plot_path)
        if same:
            record(prof, summary, model_path, workload)
        if json_out:
            print_json(summary)
        else:
            err.print(result_table(summary, profile_path, rounds))
            err.print(group_table(summary))
        if not summary["passed"]:
            b = summary["bars"]
            print(f"validation failed: R² {summary['r2']} (min {b['r2']}), MAPE {summary['mape_percent']} % "
                  f"(max {b['mape_percent']} %), median residual {summary['residual_percent_p50']:+} % "
                  f"(max ±{b['bias_percent']} %); {failure_hint(summary['probe'])}", file=sys.stderr)
            raise typer.Exit(1)


@dataclass(frozen=True)
class Bars:
    """What validation asks: R² at least, MAPE and |median residual| at most (%). None: the
    default, met where the run's noise allows it (`within_noise`); a value given is kept as is."""

    r2: float | None = None
    mape_percent: float | None = None
    bias_percent: float = 5.0

    def within_noise(self, timing: dict) -> dict:
        """The bars: a default R² no higher than the noise ceiling less ``NOISE_R2_MARGIN``, a
        default MAPE no lower than ``NOISE_MAPE_FACTOR`` × the noise's MAPE floor (a perfect model
        scores those); the bias bar stays: noise scatters passes, it does not shift their median."""
        ceiling, floor = timing.get("noise_ceiling_r2"), timing.get("noise_mape_floor_percent")
        r2, mape = self.r2, self.mape_percent
        if r2 is None:
            r2 = DEFAULT_R2 if ceiling is None else min(DEFAULT_R2, round(ceiling - NOISE_R2_MARGIN, 4))
        if mape is None:
            mape = DEFAULT_MAPE if floor is None else max(DEFAULT_MAPE, round(NOISE_MAPE_FACTOR * floor, 3))
        return {"r2": r2, "mape_percent": mape, "bias_percent": self.bias_percent,
                "within_noise": (r2, mape) != (DEFAULT_R2 if self.r2 is None else self.r2,
                                               DEFAULT_MAPE if self.mape_percent is None else self.mape_percent)}


DEFAULT_R2, DEFAULT_MAPE = 0.95, 5.0


def meets(result: dict, bar: dict) -> bool:
    """R², MAPE and the median residual, each within its bar."""
    return (result["r2"] >= bar["r2"] and result["mape_percent"] <= bar["mape_percent"]
            and abs(result["residual_percent_p50"]) <= bar["bias_percent"])


NOISE_R2_MARGIN = 0.05
NOISE_MAPE_FACTOR = 1.5


def run_validation(prof, loaded, tok, workload, n_prompts: int, tokens: int, rounds: int, bars: Bars,
                   same: bool, progress=None) -> tuple[dict, dict]:
    """Decode, replay, score: the summary validate prints and records, and the full result (with
    every pass's predicted and measured seconds). The speed probe is compared only when the model
    is the profile's (another model's reference pass is another pass)."""
    passes, probe_now = measured_passes(prof, loaded, tok, workload, n_prompts, tokens, rounds, progress)
    samples = [q.sample() for q in passes]
    if len(samples) < 3:
        raise UsageError("too few verification passes to validate; raise --n-prompts or --max-tokens")
    raw = evaluate(prof, samples)
    at_profile = (prof.data["cost_model"].get("fit") or {}).get("probe") if same else None
    probe = speed_probe.compare(at_profile, probe_now, raw["fit_ratio"], prof.costs, samples)
    scale = probe.pop("scale", None)
    result = evaluate(prof, samples, scale if probe["drift"] else None, probe["ratio"])
    single = evaluate(prof, single_shot_samples(passes))
    summary = {k: v for k, v in result.items() if k not in ("predicted", "measured")}
    # every pass as the cost model saw it, so a plot or a later fit needs no rerun
    summary["passes"] = [{"n_tokens": s["n_tokens"], "n_missing": s["n_missing"], "n_resident": s["n_resident"],
                          "measured_ms": round(m * 1e3, 4), "predicted_ms": round(q * 1e3, 4)}
                         for s, m, q in zip(samples, result["measured"], result["predicted"])]
    if probe["drift"] and scale is not None:  # what the speed probe expects of each pass: drift_adjusted's
        for point, d in zip(summary["passes"], np.broadcast_to(np.asarray(scale, dtype=np.float64), (len(samples),))):
            point["drift"] = round(float(d), 5)
    timing = {"estimator": "fastest of interleaved replays", **spread(passes)}
    bar = bars.within_noise(timing)
    summary.update(passed=meets(result, bar), bars=bar, min_r2=bar["r2"], max_mape_percent=bar["mape_percent"],
                   probe=probe, timing=timing, single_shot={"r2": single["r2"], "mape_percent": single["mape_percent"]})
    return summary, result


def failure_hint(probe: dict) -> str:
    """What a failed validation most likely means, from the speed probe's verdict."""
    if probe["verdict"] == "drift":
        return (f"the machine ran ×{probe['ratio']} its speed at profile time for these passes (speed "
                "probe): re-run s2moe-calib profile when it is steady")
    if probe["verdict"] == "model error":
        return (f"the passes ran ×{probe['fit_ratio']} the model's prediction while the speed probe expected "
                f"×{probe['ratio']}: the cost model misses a cost these passes pay (see the bias by group)")
    if probe["drift"]:  # the machine moved, though less than the bias needs to be called drift
        return (f"the speed probe moved (compute ×{probe['compute_ratio']}, reads ×{probe['reads_ratio']}): "
                "re-run s2moe-calib profile when the machine is steady, then validate right after")
    return "re-run s2moe-calib profile"


def result_table(summary: dict, profile_path: str, rounds: int) -> Table:
    t = Table(title=f"validation of {profile_path}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("r2", "mape_percent", "n", "residual_percent_p50", "residual_percent_p90_abs", "measured_ms_range"):
        t.add_row(k, str(summary[k]))
    timing = summary["timing"]
    t.add_row("timing", f"fastest of {rounds} replays (repeat CV {timing['repeat_cv_median']})")
    t.add_row("noise ceiling R² / MAPE floor %", f"{timing['noise_ceiling_r2']} / {timing['noise_mape_floor_percent']}")
    probe = summary["probe"]
    t.add_row("measured / predicted (median)", f"×{summary['fit_ratio']}")
    if probe["ratio"] is None:
        t.add_row("speed probe, now / at profile", "n/a (" + ("the profile has no probe: re-run profile"
                                                               if probe["now"] else "another model") + ")")
    else:
        t.add_row("speed probe, now / at profile", f"compute ×{probe['compute_ratio']}, reads ×{probe['reads_ratio']}")
        t.add_row("drift the passes expect", f"×{probe['ratio']} (beyond ±{probe['threshold_percent']} %): "
                                             f"{probe['verdict']}")
    d = summary.get("drift_adjusted")
    if d:
        t.add_row(f"R² / MAPE % adjusted by the probe's ×{d['probe_ratio']}", f"{d['r2']} / {d['mape_percent']}")
    t.add_row("single shot R² / MAPE %", f"{summary['single_shot']['r2']} / {summary['single_shot']['mape_percent']}")
    b = summary["bars"]
    t.add_row("bars: R² / MAPE % / |bias| %", f"≥ {b['r2']} / ≤ {b['mape_percent']} / ≤ {b['bias_percent']}"
              + (" (the noise's)" if b["within_noise"] else ""))
    t.add_row("verdict", "[green]pass[/green]" if summary["passed"] else "[red]fail[/red]")
    return t


def group_table(summary: dict) -> Table:
    t = Table(title="bias by group (measured / predicted − 1, median)")
    for col in ("group", "n", "bias %"):
        t.add_column(col, justify="left" if col == "group" else "right")
    for row in summary["bias_by_group"]:
        t.add_row(row["group"], str(row["n"]), f"{row['median_residual_percent']:+.1f}")
    return t
