"""Backs docs/gpu.md, "Status" and "Kernels" (and the machine note of docs/performance.md): GPU tests,
kernels against NumPy, AR and S²-MoE tok/s per backend and tier.

The one prepared GPU check: run the GPU tests, then time the csrc kernels against NumPy.

    pip install -e ".[cuda]" && python benchmarks/gpu.py [--out docs/results/gpu]

It first runs the GPU tests (tests/gpu and tests/test_csrc.py, without tests/conftest.py: nothing
beyond the `cuda` extra is needed; a test that needs a GPU is reported as skipped where there is
none). Where CuPy or a usable CUDA device is missing, every GPU part says it was skipped and why,
and the script exits 0 (non-zero only when a test fails). On a GPU it then measures: the router top-k
and fused reuse-aware gating kernels (one layer's routing for a decode batch and for a
verification batch) vs the NumPy reference, medians over repetitions with CUDA events; then AR and
S²-MoE decode tokens/s of the embedded model on the NumPy and CuPy backends (CuPy with the file and
the pinned-host tier) at 100 % and 25 % budgets (greedy, 4 default prompts × 32 tokens); finally
`s2moe-calib profile --backend cupy` and `validate` at 25 % (the profile lands beside the results).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import Record, machine_info, write_outputs  # noqa: E402


def decode_records() -> list:
    """AR and S²-MoE tokens/s per backend and budget (one process, interleaved per prompt)."""
    from s2moe.runtime.kernels.backend import select_backend
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.estimate import estimate_costs
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.decoding.methods import SpecSettings, get_method
    from s2moe.runtime.prompts import load_workload
    from s2moe.runtime.model.routing import RoutingPolicy
    from s2moe.runtime.decoding.speculative import SpeculativeDecoder
    from s2moe.runtime.model.tokenizer import load_tokenizer

    loaded = load_model(str(DEFAULT_MODEL))
    tok = load_tokenizer(loaded)
    prompts = [tok.encode(p).ids[:64] for p in load_workload(os.path.join(ROOT, "runtime", "assets", "prompts",
                                                                          "default.jsonl"))[:4]]
    records = []
    for backend, tier in (("numpy", "file"), ("cupy", "file"), ("cupy", "host")):
        arrays = select_backend(backend)
        for budget in ("1.0", "0.25"):
            engine = build_engine(loaded.path, budget, 512, None, loaded=loaded, backend=arrays, offload_tier=tier)
            settings = SpecSettings(draft_topk=2)
            costs = estimate_costs(engine.model, prompts[0], RoutingPolicy(top_k=2))
            for method in ("ar", "s2moe"):
                dec = SpeculativeDecoder(engine.model, get_method(method), settings, costs)
                dec.generate(prompts[0], 4)  # warm-up: kernels compile, hot experts load
                rates = [dec.generate(ids, 32).stats()["decode_tokens_per_s"] for ids in prompts]
                records.append(Record("gpu", f"{method} decode, {backend}, {tier} tier, budget {budget}", "tok/s",
                                      rates, {"backend": backend, "tier": tier, "budget": budget, "method": method}))
            engine.close()
    return records


def calibration_records(out: str) -> list:
    """`s2moe-calib profile --backend cupy` + `validate` at 25 %: porting to this GPU, as a user would."""
    import json

    path = os.path.join(ROOT, out + "-profile.json")
    run = lambda *a: subprocess.run([sys.executable, "-m", "s2moe.calib", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=ROOT)
    r = run("profile", "--device", "auto", "--backend", "cupy", "--budget", "0.25", "--out", path)
    if r.returncode:
        print(f"GPU profile failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return []
    v = run("validate", "--profile", path, "--json", "--min-r2", "-1e9", "--max-mape", "1e9")
    res = json.loads(v.stdout) if v.returncode == 0 else {}
    prof = json.load(open(path))
    extra = {"validate": res, "offload": prof["offload"], "cost_model": prof["cost_model"]}
    return [Record("gpu", "calibration at 25 %: validate R²", "R²", [res.get("r2", float("nan"))], {"budget": "0.25"},
                   extra),
            Record("gpu", "calibration at 25 %: validate MAPE", "%", [res.get("mape_percent", float("nan"))],
                   {"budget": "0.25"})]


TESTS = ["tests/gpu", "tests/test_csrc.py"]


def run_tests() -> int:
    """The GPU tests, with only what the `cuda` extra installs: tests/conftest.py (torch, for the
    reference models) is not loaded. Exit status 0 when they pass or skip, else pytest's."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("skipped: the GPU tests: pytest is not installed (pip install 's2moe[cuda]' brings it)")
        return 0
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "--noconftest", "-p", "no:cacheprovider",
                        *TESTS], cwd=ROOT)
    if r.returncode == 5:  # nothing collected
        print("skipped: the GPU tests: pytest collected none")
        return 0
    if r.returncode:
        print(f"the GPU tests failed (pytest exit status {r.returncode})", file=sys.stderr)
    return r.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="docs/results/gpu")
    args = ap.parse_args()
    from s2moe.runtime.kernels.backend import cuda_unusable_reason

    reason = cuda_unusable_reason()  # a device, and a matmul and a RawKernel that run on it
    status = run_tests()
    if reason is not None:
        for part in ("csrc kernel timings", "decode tokens/s on CuPy (file and host tiers)",
                     "calibration on CuPy (profile + validate)"):
            print(f"skipped: {part}: {reason}")
        sys.exit(status)
    import cupy as cp

    from s2moe.runtime.kernels.cuda import reuse_gating, router_topk
    from s2moe.runtime.decoding.gating import ReuseGating
    from s2moe.runtime.model.routing import route

    rng = np.random.default_rng(0)
    records = []
    for name, B, E, k in (("decode batch 1", 1, 64, 8), ("verification batch 9", 9, 64, 8),
                          ("prefill 512", 512, 128, 8)):
        logits = rng.normal(size=(B, E)).astype(np.float32)
        dev = cp.asarray(logits)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        gpu, cpu = [], []
        for _ in range(args.reps):
            start.record()
            router_topk(dev, k, "softmax_topk", False)
            end.record()
            end.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
            t0 = time.perf_counter()
            route(logits, k, "softmax_topk", False)
            cpu.append((time.perf_counter() - t0) * 1e6)
        records += [Record("gpu", f"router top-k kernel, {name}", "µs", gpu, {"B": B, "E": E, "k": k}),
                    Record("gpu", f"router top-k NumPy, {name}", "µs", cpu, {"B": B, "E": E, "k": k})]
        # the fused gating takes any batch size
        conf = rng.uniform(0.1, 1, B).astype(np.float32)
        gpu = []
        for _ in range(args.reps):
            start.record()
            reuse_gating(dev, k, 2 * k, "paper", 1.0, "softmax_topk", False, cp.asarray(conf))
            end.record()
            end.synchronize()
            gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            route(logits, k, "softmax_topk", False, ReuseGating(k, 2 * k, "paper", 1.0, conf).bias(0, logits))
        cpu = [(time.perf_counter() - t0) / args.reps * 1e6]
        records += [Record("gpu", f"fused reuse gating kernel, {name}", "µs", gpu, {"B": B, "E": E, "k": k}),
                    Record("gpu", f"reuse gating NumPy, {name}", "µs", cpu, {"B": B, "E": E, "k": k})]
    records += decode_records()
    records += calibration_records(args.out)
    write_outputs(records, machine_info(), args.out, "csrc kernels and backends on the GPU")
    sys.exit(status)


if __name__ == "__main__":
    main()
