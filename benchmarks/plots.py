"""Backs the figures of README.md ("Results"), docs/performance/peer.md,
docs/performance/s2moe-real-size.md and docs/performance/calibration.md: renders them from the
recorded results into docs/img/*.png.

    pip install -e ".[plot]" && python benchmarks/plots.py

It runs nothing: every point comes from a record in docs/results/, so a figure changes only when
its record does.
- speed-vs-budget.png: decode tokens/s against the share of experts in memory, for s2moe AR,
  S²-MoE and llama.cpp's best setting, on the widened OLMoE-1B-7B Q4_K_M
  (peer-olmoe-widened-uncapped.json at 100 %, peer-olmoe-widened-capped.json at 25 and 10 %);
- time-split.png: where a token's time goes, AR against S²-MoE (speculative-olmoe-widened.json);
- predicted-vs-measured.png: the cost model's verification time against the measured one, pass
  by pass, held out (calibration-olmoe-widened-revalidate.json, `s2moe-calib validate --json`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "docs", "results")
COLORS = {"AR": "#4c72b0", "S²-MoE": "#dd8452", "llama.cpp": "#55a868"}
LABELS = {"AR": "s2moe AR", "S²-MoE": "s2moe S²-MoE", "llama.cpp": "llama.cpp, best setting that ran"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: the plots need matplotlib: pip install -e \".[plot]\"")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _records(name: str) -> list[dict]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        sys.exit(f"error: {os.path.relpath(path, ROOT)} is missing: its benchmark writes it (see the docstring)")
    with open(path) as f:
        data = json.load(f)
    return data["records"] if isinstance(data, dict) and "records" in data else data


def _median(rec: dict) -> float | None:
    return statistics.median(rec["samples"]) if rec.get("samples") else None


def speed_points(records: list[dict]) -> dict[str, float]:
    """One setting's tokens/s per program: s2moe AR, S²-MoE, and llama.cpp's fastest setting (a
    setting killed or crashed in every round has no samples and no say)."""
    out, llama = {}, []
    for r in records:
        med = _median(r)
        program = r["params"]["program"]
        if med is None:
            continue
        if program == "s2moe":
            out["AR"] = med
        elif program == "s2moe s2moe":
            out["S²-MoE"] = med
        elif program.startswith("llama.cpp"):
            llama.append(med)
    if llama:
        out["llama.cpp"] = max(llama)
    return out


def speed_vs_budget(plt, out: str) -> str:
    by_share: dict[float, dict[str, float]] = {}
    for name in ("peer-olmoe-widened-uncapped.json", "peer-olmoe-widened-capped.json"):
        settings: dict[str, list[dict]] = {}
        for r in _records(name):
            settings.setdefault(r["params"]["setting"], []).append(r)
        for setting, recs in settings.items():
            share = 1.0 if setting == "uncapped" else float(setting.split()[1].rstrip("%")) / 100
            by_share[share] = speed_points(recs)
    shares = sorted(by_share)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for program, color in COLORS.items():
        xs = [s * 100 for s in shares if program in by_share[s]]
        ys = [by_share[s][program] for s in shares if program in by_share[s]]
        ax.plot(xs, ys, "o-", color=color, label=LABELS[program])
        for x, y in zip(xs, ys):  # at full budget the three meet: labels stacked left of the points
            offset = ((6, {"AR": -12, "S²-MoE": 5, "llama.cpp": 5}[program]) if x < 100 else
                      (7, {"AR": 3, "S²-MoE": -4, "llama.cpp": -11}[program]))
            ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=offset, fontsize=8, color=color)
    ax.set_yscale("log")
    ax.set_ylim(top=max(max(v.values()) for v in by_share.values()) * 1.8)
    ax.set_xlabel("experts in memory (% of their stored bytes)")
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_xticks([s * 100 for s in shares])
    ax.set_xlim(right=max(shares) * 100 + 14)  # room for the full-budget labels
    ax.set_title("OLMoE-1B-7B shape (trained routing), Q4_K_M, 2 threads; under 100 %: each program\n"
                 "in a memory cgroup of its baseline + dense + that share of experts", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "speed-vs-budget.png")
    save(fig, path)
    plt.close(fig)
    return path


PARTS = (("draft_compute", "draft compute"), ("verify_compute", "verify compute"),
         ("other_compute", "other compute"), ("fetch_critical", "fetch on the critical path"))


def time_split(plt, out: str) -> str:
    """Stacked ms per emitted token on HumanEval at each budget; hidden fetches ran beside compute,
    so they are drawn beside the bar, not in it."""
    bars = []
    for r in _records("speculative-olmoe-widened.json"):
        p = r["params"]
        if p["method"] in ("ar", "s2moe") and p["workload"].startswith("human-eval"):
            label = f"{'AR' if p['method'] == 'ar' else 'S²-MoE'}\n{float(p['budget']):.0%}"
            bars.append((float(p["budget"]), p["method"] != "ar", label, r["extra"]["ms_per_token"]))
    bars.sort(key=lambda b: (-b[0], b[1]))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    palette = ("#dd8452", "#c44e52", "#8172b3", "#4c72b0")
    for (key, label), color in zip(PARTS, palette):
        heights = [b[3].get(key, 0.0) for b in bars]
        ax.bar(xs, heights, 0.55, bottom=bottom, label=label, color=color)
        bottom = [lo + h for lo, h in zip(bottom, heights)]
    hidden = [b[3].get("fetch_hidden", 0.0) for b in bars]
    ax.bar([x + 0.33 for x in xs], hidden, 0.12, color="#cccccc", hatch="//", label="fetch hidden (beside compute)")
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.0f} ms", (x, total), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(list(xs), [b[2] for b in bars])
    ax.set_ylabel("ms per emitted token")
    ax.set_title("Where a token's time goes: OLMoE-1B-7B widened, Q4_K_M, HumanEval, real disk", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "time-split.png")
    save(fig, path)
    plt.close(fig)
    return path


def predicted_vs_measured(plt, out: str) -> str:
    import numpy as np

    from s2moe.runtime.decoding.cost_model import mape, r2

    path_in = os.path.join(RESULTS, "calibration-olmoe-widened-revalidate.json")
    with open(path_in) as f:
        res = json.load(f)
    if "passes" not in res:
        sys.exit(f"error: {os.path.relpath(path_in, ROOT)} has no passes: record it with s2moe-calib validate --json")
    meas = [p["measured_ms"] for p in res["passes"]]
    pred = [p["predicted_ms"] for p in res["passes"]]
    tokens = [p["n_tokens"] for p in res["passes"]]
    probe = res.get("probe") or {}
    ratio = probe.get("ratio") if probe.get("drift") else None
    fig, ax = plt.subplots(figsize=(5.2, 4.8))
    sc = ax.scatter(meas, pred, c=tokens, s=14, cmap="viridis", alpha=0.8, label="the profile's prediction")
    fig.colorbar(sc, ax=ax, label="tokens in the pass")
    title = f"held out, n {res['n']}: R² {res['r2']:.3f}, MAPE {res['mape_percent']:.1f} %"
    if ratio:  # the speed probe saw the machine move since the profile: the same model, rescaled
        drift = [p.get("drift", ratio) for p in res["passes"]]  # per pass where validate kept it
        scaled = [q * d for q, d in zip(pred, drift)]
        q = np.array(scaled)  # the scores validate uses (cost_model.r2 / mape)
        label = (f"× the speed probe's drift (median {statistics.median(drift):.3f})"
                 if "drift" in res["passes"][0] else f"× {ratio:.3f}, the speed probe's drift")
        ax.scatter(meas, scaled, s=10, facecolors="none", edgecolors="#c44e52", alpha=0.6, label=label)
        title += f"\nscaled by the drift: R² {r2(meas, q):.3f}, MAPE {100 * mape(meas, q):.1f} %"
    lo, hi = min(meas + pred), max(meas + pred)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
    ax.set_xlabel("measured verification pass (ms)")
    ax.set_ylabel("predicted (ms)")
    ceiling = res["timing"]["noise_ceiling_r2"]
    ax.set_title(f"{title}\nnoise ceiling R² {ceiling:.3f}, MAPE floor "
                 f"{res['timing']['noise_mape_floor_percent']:.1f} %", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out, "predicted-vs-measured.png")
    save(fig, path)
    plt.close(fig)
    return path


def save(fig, path: str) -> str:
    """Temp file + rename, mode 0644: a figure is whole or absent."""
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"), help="folder for the PNGs")
    args = ap.parse_args()
    plt = _pyplot()
    os.makedirs(args.out, exist_ok=True)
    for draw in (speed_vs_budget, time_split, predicted_vs_measured):
        print(os.path.relpath(draw(plt, args.out), ROOT))


if __name__ == "__main__":
    main()
