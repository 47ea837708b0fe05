"""Backs docs/performance/s2moe-real-size.md, "The defaults at this size": settings of S²-MoE (and AR)
side by side, prompt by prompt, taking turns.

    python benchmarks/tune.py --model WIDENED.gguf --budget 0.25 --n-prompts 12 \\
        --arm ar:method=ar --arm default --arm k1:draft_topk=1 --arm cap4:draft_cap=4 \\
        --out docs/results/tune-olmoe-widened-0.25

An arm is ``LABEL[:FIELD=VALUE,...]``: `SpecSettings` fields (draft_topk, draft_cap, rg_residency,
rg_strength, prefetch_slots, utility_threshold, ...) over the defaults, and ``method`` (s2moe unless
told). Every arm keeps its own engine and decoder for a workload, as `s2moe bench` does, but the
arms run each prompt in turn, the order rotating by one each prompt: this machine drifts by tens of
percent within minutes, and a sweep that ran one configuration after another compared minutes
apart. An arm's figure against the reference arm is the ratio of their summed decode seconds over
the same prompts (EOS ignored, so every arm emits the same number of tokens), with a 95 % bootstrap
interval over prompts.

Writes raw records (per-prompt samples and seconds, the arm's settings, machine, commit) to
``--out``.json / .csv and prints markdown tables. Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402
from s2moe.runtime.decoding.methods import METHODS  # noqa: E402

WORKLOADS = ("humaneval", "gsm8k", "mt-bench")
PARTS = ("draft_compute", "verify_compute", "other_compute", "fetch_critical", "fetch_hidden", "total")


def parse_arm(text: str, base, validate) -> tuple[str, str, object, dict]:
    """``LABEL[:FIELD=VALUE,...]`` → (label, method, settings, the fields changed)."""
    label, _, rest = text.partition(":")
    fields = {f.name: f for f in dataclasses.fields(base)}
    method, changed = "s2moe", {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key == "method" and eq:
            if value not in METHODS:  # before the model loads, not after
                sys.exit(f"--arm {text!r}: method {value!r}: choose from {', '.join(METHODS)}")
            method = value
            continue
        if key not in fields or not eq:
            sys.exit(f"--arm {text!r}: {item!r} is not FIELD=VALUE with a SpecSettings field "
                     f"(e.g. draft_topk, draft_cap, rg_strength, rg_residency, prefetch_slots) or method")
        current = getattr(base, key)
        kind = type(current) if current is not None else (int if key == "prefetch_slots" else float)
        changed[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return label, method, validate(dataclasses.replace(base, **changed)), changed


def bootstrap_ratio(ref: np.ndarray, arm: np.ndarray, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Σ ref seconds / Σ arm seconds (the arm's speedup), with a 95 % interval resampling prompts."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(ref), size=(draws, len(ref)))
    boot = ref[idx].sum(axis=1) / arm[idx].sum(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(ref.sum() / arm.sum()), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded model)")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arm", action="append", default=[], help="LABEL[:FIELD=VALUE,...] (repeat)")
    ap.add_argument("--reference", default="default", help="the arm the others are compared with")
    ap.add_argument("--emulate-bandwidth", type=float, default=None)
    ap.add_argument("--emulate-latency", type=float, default=0.0)
    ap.add_argument("--no-live-costs", action="store_true")
    ap.add_argument("--out", default="docs/results/tune")
    args = ap.parse_args()

    from rich.progress import Progress

    from s2moe.runtime.bench import MethodRun, kv_positions_for, with_speedups, workload_ids
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.cli.spec_options import make_settings
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.decoding.methods import SpecSettings
    from s2moe.runtime.decoding.sampling import SamplingParams
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(args.model or str(DEFAULT_MODEL))
    tok = load_tokenizer(loaded)
    cfg = loaded.config
    base = make_settings(cfg, None, None, None, None, SpecSettings.rg_variant)
    arms = [parse_arm(a, base, lambda s: s.validate(cfg.top_k, cfg.num_experts, cfg.moe_layer_ids))
            for a in args.arm or ["ar:method=ar", "default"]]
    labels = [a[0] for a in arms]
    if args.reference not in labels or len(set(labels)) != len(labels):
        sys.exit(f"--arm: labels must be distinct and include --reference {args.reference!r} (got {labels})")
    engine_kw = ({"emulate_bandwidth": args.emulate_bandwidth, "emulate_latency": args.emulate_latency}
                 if args.emulate_bandwidth else {})
    records: list[Record] = []
    with Progress(transient=True) as progress:
        for workload in args.workloads.split(","):
            path, ids = workload_ids(tok, workload, args.n_prompts)
            kv = max(kv_positions_for(ids, args.max_tokens, s) for _, _, s, _ in arms)
            runs, seconds = [], {label: [] for label in labels}
            for label, method, settings, _ in arms:
                runs.append(MethodRun(loaded, method, settings, args.budget, kv, ids[0], None, SamplingParams(),
                                      engine_kw=engine_kw, estimate=estimate_costs, live=not args.no_live_costs))
            task = progress.add_task(workload, total=len(ids) * len(arms))
            for i, p in enumerate(ids):
                for j in range(len(arms)):  # the order rotates by one each prompt
                    k = (i + j) % len(arms)
                    seconds[labels[k]].append(runs[k].run(p, args.max_tokens).decode_seconds)
                    progress.update(task, advance=1, description=f"{workload} · {labels[k]}")
            batch = []
            for (label, method, settings, changed), run in zip(arms, runs):
                r = run.finish(path.name, args.budget, cfg.top_k, args.max_tokens)
                r.name = label
                r.params.update(arm=label, changed=changed, order="rotating per prompt")
                r.extra["prompt_seconds"] = seconds[label]
                batch.append(r)
            with_speedups(batch, base_name="ar" if "ar" in labels else args.reference)
            records += batch
    write_outputs(records, machine_info(), args.out, "settings taking turns")
    print_summary(records, labels, args.reference)


def print_summary(records: list[Record], labels: list[str], reference: str) -> None:
    """Markdown: each arm against the reference per workload and over every prompt, then where its
    token's time goes."""
    by = {(r.params["workload"], r.name): r for r in records}
    workloads = list(dict.fromkeys(r.params["workload"] for r in records))
    print(f"| arm | settings | " + " | ".join(f"{w} vs {reference}" for w in workloads)
          + " | all prompts | tok/s | acceptance length | reuse ratio | KiB fetched/token |")
    print("|---|---|" + "---|" * (len(workloads) + 5))
    for label in labels:
        cells, ref_all, arm_all = [], [], []
        for w in workloads:
            ref, arm = (np.array(by[(w, n)].extra["prompt_seconds"]) for n in (reference, label))
            ref_all.append(ref)
            arm_all.append(arm)
            cells.append("{:.2f}× [{:.2f}, {:.2f}]".format(*bootstrap_ratio(ref, arm)))
        pooled = "{:.2f}× [{:.2f}, {:.2f}]".format(*bootstrap_ratio(np.concatenate(ref_all), np.concatenate(arm_all)))
        xs = [by[(w, label)].extra for w in workloads]
        reuse = [x["reuse_ratio"] for x in xs if x["reuse_ratio"] is not None]
        changed = by[(workloads[0], label)].params["changed"]
        method = by[(workloads[0], label)].params["method"]
        named = ([] if method == "s2moe" else ["AR" if method == "ar" else f"method={method}"])
        setting = ", ".join(named + [f"{k}={v}" for k, v in changed.items()]) or "defaults"
        print(f"| {label} | {setting} | " + " | ".join(cells) + f" | **{pooled}** | "
              + " / ".join(f"{x['decode_tokens_per_s_aggregate']:.1f}" for x in xs) + " | "
              + " / ".join(f"{x['acceptance_length']:.2f}" for x in xs) + " | "
              + (f"{statistics.mean(reuse):.3f}" if reuse else "-") + " | "
              + f"{statistics.mean(x['bytes_fetched_per_token'] for x in xs) / 1024:.0f} |")
    print("\n| arm | " + " | ".join(PARTS) + " |  (ms per emitted token, mean over workloads)")
    print("|---|" + "---|" * len(PARTS))
    for label in labels:
        xs = [by[(w, label)].extra["ms_per_token"] for w in workloads]
        print(f"| {label} | " + " | ".join(f"{statistics.mean(x[k] for x in xs):.1f}" for k in PARTS) + " |")


if __name__ == "__main__":
    main()
