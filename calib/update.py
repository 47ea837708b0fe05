"""`s2moe-calib profile --update PROFILE --passes FILE`: refit a profile from a run's own passes.

`s2moe run --record-passes FILE` writes the passes a real run made (runtime/decoding/pass_log.py).
They replace the profile's in-situ decode passes in the same fit `profile` makes: the profile's
controlled passes (its samples file, when it sits beside the profile) enter at a small weight
(chosen as `profile` chooses it, by cross-validation on the run's passes) and keep the features
identifiable; the run's passes carry the fit. T_AR and C_draft become the medians of the run's
AR steps and draft phases when it made enough of them; otherwise they stay, and the summary says so.

The profile is only rewritten whole (temp + rename), and only for passes of its own model, backend,
emulation and budget: anything else would mix two devices' constants.
"""

from __future__ import annotations

import datetime
import json
import os

import numpy as np

from s2moe.runtime import jsonfile
from s2moe.runtime.decoding.cost_model import FEATURES

MIN_PASSES = 10  # below this a refit is noise; say how to get more
MIN_STEPS = 4  # AR steps or draft phases needed to replace T_AR or C_draft


def _head(n: int) -> str:
    return f"a draft head of {n} tokens" if n else "the full head"


def _same_run_conditions(log: dict, prof, passes_path: str) -> None:
    from s2moe.runtime.errors import UsageError

    from .fit_export import same_measurement

    same_measurement(log, prof, passes_path)  # model fingerprint
    device = prof.data["device"]
    wanted = {"backend": device.get("backend"), "emulation": device.get("emulation"),
              "budget": prof.data["budget"]["spec"]}
    for field, want in wanted.items():
        if field == "backend" and want is None:
            continue  # profiles of older versions do not record it
        if log.get(field) != want:
            raise UsageError(f"{prof.path}: measured with {field} {want!r}, but {passes_path} was recorded with "
                             f"{log.get(field)!r}; record a run with the profile's settings (s2moe run --profile "
                             f"{prof.path} --record-passes FILE)")


def _controlled_samples(prof) -> list[dict]:
    """The profile's controlled passes, when its samples file sits beside it (else none)."""
    from .fit_export import check_samples

    name = (prof.data.get("provenance") or {}).get("samples")
    if not name:
        return []
    path = os.path.join(os.path.dirname(os.path.abspath(prof.path)), name)
    try:
        with open(path) as f:
            data = jsonfile.load(f)
        controlled = data["verification"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if data.get("fingerprint") != prof.data["model"]["fingerprint"]:
        return []
    check_samples(path, controlled, "verification")
    return controlled


def updated_profile(profile_path: str, passes_path: str) -> tuple[dict, dict]:
    """The refitted profile data and a summary of what changed; writes nothing."""
    from s2moe.runtime.checks import number
    from s2moe.runtime.decoding.pass_log import read_pass_log
    from s2moe.runtime.errors import UsageError
    from s2moe.runtime.profile import load_profile

    from .profile_cmd import fit_cost_model, fit_details

    prof = load_profile(profile_path)
    log = read_pass_log(passes_path)
    _same_run_conditions(log, prof, passes_path)
    passes = log["verification"] + log["ar"]
    if len(passes) < MIN_PASSES:
        raise UsageError(f"--passes {passes_path}: {len(passes)} timed passes, at least {MIN_PASSES} are needed; "
                         "record a longer run (--max-tokens)")
    controlled = _controlled_samples(prof)
    model, r2, mape = fit_cost_model(controlled, passes)
    X = np.array([[p[f] for f in FEATURES] for p in passes], dtype=np.float64)
    y = np.array([p["seconds"] for p in passes])
    ms = 1e3
    data = json.loads(json.dumps(prof.data))  # a copy: the old profile stays intact until the rename
    c = data["cost_model"]
    old = {k: c[k] for k in ("t_ar_ms", "c_draft_ms", "t_exp_miss_ms", "t_exp_hit_ms", "t_base_ms", "t_token_ms")}
    c.update({"t_base_ms": model.intercept_ * ms, "t_token_ms": model.coef_[0] * ms,
              "t_exp_miss_ms": model.coef_[1] * ms, "t_exp_hit_ms": model.coef_[2] * ms})
    for key in ("t_base_ms", "t_token_ms", "t_exp_miss_ms", "t_exp_hit_ms"):
        number(f"{passes_path}: fitted {key}", c[key])  # finite, or one line (the passes are degenerate)
    kept = []
    if not controlled:
        # a feature the run never varied (no misses at budget 1.0) cannot be told from the base cost
        # without the profile's controlled passes: keep its constant, and move the difference into the
        # base so every prediction on the run stays what the fit made it
        for j, key in enumerate(("t_token_ms", "t_exp_miss_ms", "t_exp_hit_ms")):
            column = X[:, j]
            base = c["t_base_ms"] + (c[key] - old[key]) * column[0]
            if np.ptp(column) == 0 and base >= 0:
                c[key], c["t_base_ms"] = old[key], base
                kept.append(f"{key} (the run never varied {FEATURES[j]})")
    steps = [p["seconds"] for p in log["ar"]] or [p["seconds"] for p in log["verification"] if p["n_tokens"] == 1]
    if len(steps) >= MIN_STEPS:
        c["t_ar_ms"], c["t_ar_p90_ms"] = float(np.median(steps)) * ms, float(np.percentile(steps, 90)) * ms
    else:
        kept.append("T_AR (too few AR steps in the run)")
    drafts = [d["seconds"] / d["tokens"] for d in log["draft"] if d["tokens"] > 0]
    head, run_head = prof.speculative.get("draft_vocab", 0), log.get("draft_vocab", 0)
    if head != run_head:  # another lm head costs another C_draft: the run's says nothing of the profile's
        kept.append(f"C_draft (the run drafted with {_head(run_head)}, the profile's C_draft is for {_head(head)})")
    elif len(drafts) >= MIN_STEPS:
        c["c_draft_ms"] = float(np.median(drafts)) * ms
    else:
        kept.append("C_draft (too few draft phases in the run)")
    fit = dict(c.get("fit") or {})
    fit.pop("probe", None)  # the speed probe timed the machine the old constants came from, not the run
    fit.update({"r2": round(r2, 5), "mape_percent": round(mape * 100, 3), "n": len(controlled) + len(passes),
                "n_controlled": len(controlled), "n_decode": len(passes),
                "run_r2": round(model.score(X, y), 5), "run_mape_percent": round(model.mape(X, y) * 100, 3),
                **fit_details(model, "the run's passes")})
    c["fit"] = fit
    if data.get("source") == "published":  # its constants are no longer the published ones
        data["source"] = "measured"
        data.pop("published", None)
    data["validation"] = None  # a verdict on the old constants says nothing about these
    prov = data.setdefault("provenance", {})
    prov["updated"] = {"passes": os.path.basename(passes_path), "n_passes": len(passes),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    summary = {"before": {k: round(v, 6) for k, v in old.items()},
               "after": {k: round(c[k], 6) for k in old}, "kept": kept, "fit": fit}
    return data, summary


def run_update(profile_path: str, passes_path: str) -> dict:
    """Refit and rewrite the profile (atomically); the summary of what changed."""
    from s2moe.runtime.profile import save_profile

    data, summary = updated_profile(profile_path, passes_path)
    save_profile(profile_path, data)
    return summary
