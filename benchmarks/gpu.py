"""Backs docs/gpu.md, "Status", "Kernels" and "At real size" (and the machine note of
docs/performance.md): the one prepared GPU check, at the size users run.

    pip install -e ".[cuda]" && python benchmarks/gpu.py            # on a GPU: the whole device check
    pip install -e ".[cuda]" && python benchmarks/gpu.py --dry-run  # anywhere: the CPU stand-in

Steps, each started only while --budget-s (600 s) has time left (else reported skipped):
1. the GPU tests (tests/gpu, tests/test_csrc.py; nothing beyond the `cuda` extra: no torch);
2. the real-size file, made in --models unless there: OLMoE-1B-7B's shapes (hidden 2048, 16 layers,
   64 experts of 1024, top-8) in Q4_K_M's two types (Q4_K, Q6_K for the down projections, v and the
   head: `benchmarks/real_models.py --type Q4_K_MIX`), random weights (speed, not text); or --model;
3. the router and fused gating kernels against NumPy (CUDA events);
4. AR and S²-MoE decode tok/s at 100 / 25 / 10 % budgets, experts missing from the device read from
   the file (file tier) or from pinned host memory (host tier); per prompt the two methods alternate;
5. `s2moe-calib profile --backend cupy` + `validate` at 25 % on that file.
It prints one table (stdout) and writes --out .json / .csv records.

Where CuPy or a usable CUDA device is missing, steps 3–5 say they were skipped and why, and the
script exits 0 (non-zero only when a test fails). --dry-run runs every step on the CPU stand-in for
CuPy (tests/fake_cupy.py: the CUDA source compiled for the host) with the sizes scaled down (2
layers, hidden 256, experts of 256, a short run): it proves the script end to end in CI; its times
say nothing about a GPU, and its records (marked dry_run) go to a temporary folder by default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import Record, machine_info  # noqa: E402

PRESET = "olmoe-1b-7b"
FILE_TYPE = "Q4_K_MIX"
DRY_SHAPE = dict(layers=2, hidden=256, heads=2, kv_heads=2, ffn=256, vocab=6144)  # real head width, expert count, top-k
BUDGETS = ("1.0", "0.25", "0.10")
TIERS = ("file", "host")
STANDIN = "S2MOE_GPU_STANDIN"  # set: this process and its children use the CPU stand-in for CuPy


def use_standin() -> None:
    """`import cupy` gives the CPU stand-in (and `cupyx` its pinned allocator)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fake_cupy

    sys.modules["cupy"] = fake_cupy.module
    sys.modules["cupyx"] = types.SimpleNamespace(empty_pinned=fake_cupy.module.empty_pinned)
    os.environ[STANDIN] = "1"


class Clock:
    def __init__(self, budget_s: float):
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def make_file(models: str, dry: bool) -> str:
    """The real-size Q4_K_MIX file in ``models`` (made once; taken when there)."""
    from benchmarks import real_models

    path = os.path.join(models, f"{PRESET}-{FILE_TYPE.lower()}{'-dry' if dry else ''}.gguf")
    if not os.path.exists(path):
        os.makedirs(models, exist_ok=True)
        real_models.write(PRESET, FILE_TYPE, path, override=DRY_SHAPE if dry else None)
    return path


def kernel_records(reps: int) -> list:
    """The router top-k and fused reuse-aware gating kernels vs NumPy (one layer's routing)."""
    import cupy as cp

    from s2moe.runtime.decoding.gating import ReuseGating
    from s2moe.runtime.kernels.cuda import reuse_gating, router_topk
    from s2moe.runtime.model.routing import route

    rng = np.random.default_rng(0)
    records = []
    for name, B, E, k in (("decode batch 1", 1, 64, 8), ("verification batch 9", 9, 64, 8)):
        logits = rng.normal(size=(B, E)).astype(np.float32)
        conf = rng.uniform(0.1, 1, B).astype(np.float32)
        dev, dconf = cp.asarray(logits), cp.asarray(conf)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        samples = {"router top-k kernel": [], "fused reuse gating kernel": [], "reuse gating NumPy": []}
        for _ in range(reps):
            for label, fn in (("router top-k kernel", lambda: router_topk(dev, k, "softmax_topk", False)),
                              ("fused reuse gating kernel",
                               lambda: reuse_gating(dev, k, 2 * k, "paper", 1.0, "softmax_topk", False, dconf))):
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[label].append(cp.cuda.get_elapsed_time(start, end) * 1e3)
            t0 = time.perf_counter()
            route(logits, k, "softmax_topk", False, ReuseGating(k, 2 * k, "paper", 1.0, conf).bias(0, logits))
            samples["reuse gating NumPy"].append((time.perf_counter() - t0) * 1e6)
        records += [Record("gpu", f"{label}, {name}", "µs", s, {"B": B, "E": E, "k": k})
                    for label, s in samples.items()]
    return records


def decode_records(path: str, n_prompts: int, tokens: int, clock: Clock, dry: bool) -> list:
    """AR and S²-MoE tok/s per tier and budget on CuPy (greedy; per prompt the methods alternate)."""
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.kernels.backend import select_backend
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.routing import RoutingPolicy
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.prompts import load_workload

    loaded = load_model(path)
    tok = load_tokenizer(loaded)
    texts = load_workload(os.path.join(ROOT, "runtime", "assets", "prompts", "default.jsonl"))[:n_prompts]
    prompts = [tok.encode(p).ids[:8 if dry else 48] for p in texts]
    arrays = select_backend("cupy")
    settings = SpecSettings(draft_topk=loaded.config.top_k // 2)
    records = []
    for tier in TIERS:
        for budget in BUDGETS:
            if clock.left() < 60 and not dry:
                print(f"skipped: decode, {tier} tier, budget {budget}: out of time")
                continue
            engine = build_engine(path, budget, 256, None, loaded=loaded, backend=arrays, offload_tier=tier)
            costs = estimate_costs(engine.model, prompts[0], RoutingPolicy(top_k=settings.draft_topk))
            decs = {m: SpeculativeDecoder(engine.model, get_method(m), settings, costs) for m in ("ar", "s2moe")}
            for dec in decs.values() if not dry else ():
                dec.generate(prompts[0], 2)  # warm-up: kernels compile, hot experts load
            rates = {m: [] for m in decs}
            for i, ids in enumerate(prompts):
                for m in (("ar", "s2moe") if i % 2 == 0 else ("s2moe", "ar")):
                    rates[m].append(decs[m].generate(ids, tokens).stats()["decode_tokens_per_s"])
            params = {"model": os.path.basename(path), "tier": tier, "budget": budget, "backend": "cupy",
                      "dry_run": dry, "tokens": tokens}
            for m, r in rates.items():
                records.append(Record("gpu", f"{m} decode, {tier} tier, budget {budget}", "tok/s", r,
                                      {**params, "method": m}))
            engine.close()
    return records


def calibration_records(path: str, out: str, dry: bool, clock: Clock) -> list:
    """`s2moe-calib profile --backend cupy` + `validate` at 25 %: porting to this GPU, as a user would."""
    profile = out + "-profile.json"
    quick = ["--samples", "10", "--n-prompts", "1", "--decode-tokens", "4", "--rounds", "1", "--draft-topk", "4"]
    full = ["--samples", "40", "--n-prompts", "4", "--decode-tokens", "12", "--rounds", "3"]
    check = ["--n-prompts", "2", "-n", "6" if dry else "16", "--rounds", "1" if dry else "3"]
    if dry:  # routing traces cover the whole workload: 8 short prompts (~25 tokens) instead of 56 long ones
        from s2moe.runtime.prompts import load_workload

        small = out + "-workload.jsonl"
        texts = load_workload(os.path.join(ROOT, "runtime", "assets", "prompts", "default.jsonl"))[:8]
        with open(small, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": t[:96]}) + "\n" for t in texts)
        quick += ["--workload", small]

    def calib(*args):
        try:
            return subprocess.run([sys.executable, os.path.abspath(__file__), "--calib", *args], capture_output=True,
                                  text=True, cwd=ROOT, timeout=None if dry else max(30.0, clock.left()))
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 124, "", f"out of time (--budget-s) in {args[0]}")

    r = calib("profile", "--device", "auto", "--backend", "cupy", "--model", path, "--budget", "0.25", "--out", profile,
              *(quick if dry else full))
    if r.returncode:
        print(f"GPU profile failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return []
    # no bar: the record is the R² and MAPE, whatever they are (a dry run's tiny passes miss a 5 % bias bar)
    v = calib("validate", "--profile", profile, "--json", "--min-r2", "-1e9", "--max-mape", "1e9", "--max-bias", "1e9",
              *check)
    res = json.loads(v.stdout) if v.returncode == 0 else {}
    if v.returncode:
        print(f"GPU validate failed:\n{v.stderr[-2000:]}", file=sys.stderr)
    params = {"budget": "0.25", "model": os.path.basename(path), "dry_run": dry}
    extra = {"validate": res, "profile": os.path.relpath(profile, ROOT)}
    return [Record("gpu", "calibration at 25 %: validate R²", "R²", [res.get("r2", float("nan"))], params, extra),
            Record("gpu", "calibration at 25 %: validate MAPE", "%", [res.get("mape_percent", float("nan"))], params)]


TESTS = ["tests/gpu", "tests/test_csrc.py"]


def run_tests(paths: list) -> int:
    """The GPU tests, with only what the `cuda` extra installs: tests/conftest.py (torch, for the
    reference models) is not loaded. Exit status 0 when they pass or skip, else pytest's."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("skipped: the GPU tests: pytest is not installed (pip install 's2moe[cuda]' brings it)")
        return 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "--noconftest", "-p", "no:cacheprovider",
                        *paths], cwd=ROOT)
    if r.returncode == 5:  # nothing collected
        print("skipped: the GPU tests: pytest collected none")
        return 0
    if r.returncode:
        print(f"the GPU tests failed (pytest exit status {r.returncode})", file=sys.stderr)
    return r.returncode


def summary(records: list) -> None:
    """One table on stdout: AR and S²-MoE per tier and budget with the speed-up; calibration below."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="s2moe on the GPU" + (" (dry run: CPU stand-in, times mean nothing)"
                                              if any(r.params.get("dry_run") for r in records) else ""))
    for col in ("tier", "budget", "AR tok/s", "S²-MoE tok/s", "S²-MoE / AR"):
        table.add_column(col, justify="right")
    rows = {(r.params["tier"], r.params["budget"], r.params["method"]): r.median for r in records if r.unit == "tok/s"}
    for tier in TIERS:
        for budget in BUDGETS:
            ar, s2 = rows.get((tier, budget, "ar")), rows.get((tier, budget, "s2moe"))
            if ar is not None and s2 is not None:
                table.add_row(tier, f"{float(budget):.0%}", f"{ar:.1f}", f"{s2:.1f}", f"{s2 / ar:.2f}×")
    calib = {r.unit: r.median for r in records if r.name.startswith("calibration")}
    if calib:
        table.caption = f"calibration at 25 %: validate R² {calib['R²']:.3f}, MAPE {calib['%']:.2f} %"
    Console(width=120).print(table)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--calib":  # a child: s2moe-calib, on the stand-in when asked
        if os.environ.get(STANDIN):
            use_standin()
        import runpy

        sys.argv = ["s2moe-calib", *sys.argv[2:]]
        runpy.run_module("s2moe.calib", run_name="__main__")
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="run every step on the CPU stand-in, sizes scaled down")
    ap.add_argument("--out", help="records stem (default docs/results/gpu; dry run: a temporary folder)")
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/s2moe-gpu"), help="where the file is made")
    ap.add_argument("--model", help="decode and calibrate this file instead of making one")
    ap.add_argument("--budget-s", type=float, default=600, help="start no step past this many seconds")
    ap.add_argument("--reps", type=int, default=200, help="kernel timing repetitions")
    ap.add_argument("--no-tests", action="store_true", help="skip step 1 (CI runs the tests itself)")
    ap.add_argument("--tests", nargs="+", default=TESTS, metavar="PATH",
                    help=f"pytest paths or node ids for step 1 (default: {' '.join(TESTS)})")
    args = ap.parse_args()
    clock = Clock(args.budget_s)
    dry = args.dry_run
    out = args.out or (os.path.join(tempfile.mkdtemp(prefix="s2moe-gpu-"), "gpu") if dry else "docs/results/gpu")
    if dry:
        use_standin()
    from s2moe.runtime.kernels.backend import cuda_unusable_reason

    reason = cuda_unusable_reason()  # a device, and a matmul and a RawKernel that run on it
    status = 0 if args.no_tests else run_tests(args.tests)
    if reason is not None:
        for part in ("csrc kernel timings", "decode tokens/s on CuPy (file and host tiers)",
                     "calibration on CuPy (profile + validate)"):
            print(f"skipped: {part}: {reason}")
        sys.exit(status)
    steps = {}

    def step(name, fn):
        t0 = time.monotonic()
        result = fn()
        steps[name] = round(time.monotonic() - t0, 1)
        print(f"{name}: {steps[name]} s", file=sys.stderr)
        return result

    path = args.model or step("real-size file", lambda: make_file(args.models, dry))
    records = step("kernels", lambda: kernel_records(3 if dry else args.reps))
    records += step("decode", lambda: decode_records(path, 1 if dry else 4, 3 if dry else 32, clock, dry))
    if clock.left() > 120 or dry:
        records += step("calibration", lambda: calibration_records(path, out, dry, clock))
    else:
        print("skipped: calibration on CuPy (profile + validate): out of time")
    from s2moe.runtime.outputs import write_atomic
    from s2moe.runtime.records import to_csv, to_json

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_atomic(out + ".json", to_json(records, {**machine_info(), "dry_run": dry, "step_seconds": steps}))
    write_atomic(out + ".csv", to_csv(records))
    summary(records)
    print(f"records: {out}.json, {out}.csv")
    sys.exit(status)


if __name__ == "__main__":
    main()
