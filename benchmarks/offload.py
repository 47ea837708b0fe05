"""Expert offloading: raw O_DIRECT bandwidth vs achieved expert-fetch bandwidth, AR decode speed at
several budgets, and cache hit rates per replacement policy.

    python benchmarks/offload.py [--reps 3] [--tokens 24] [--skip-policies]

Part A uses a generated OLMoE-style model whose experts are ≥ 1 MiB (3 MiB in fp16), so reads
dominate; Part B measures hit rates per policy on the embedded default model with its held-out
prompts (real, skewed routing; a random model's routing says nothing about policies).
Results: tables on stderr, JSON/CSV under docs/results/offload.*.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402
from benchmarks.synthetic import write_olmoe  # noqa: E402

CHUNK = 8 << 20


def raw_direct_read(path: str) -> float:
    """Sequential O_DIRECT read of the whole file in 8 MiB requests; returns bytes/s."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, CHUNK)
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    off = 0
    while off < size:
        got = os.preadv(fd, [buf], off)
        if got <= 0:
            break
        off += got
    dt = time.perf_counter() - t0
    os.close(fd)
    return size / dt


def expert_reads_only(store, loaded, rng, threads: int) -> float:
    """The store's own reads (aligned O_DIRECT, coalesced per expert), concurrently, no decode."""
    from concurrent.futures import ThreadPoolExecutor

    keys = list(loaded.experts)
    rng.shuffle(keys)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda k: store.read_undecoded(*k), keys))
    return total / (time.perf_counter() - t0)


def expert_fetch(store, loaded, rng, per_pass: int) -> float:
    """Every expert once, in random order, fetched per_pass at a time per layer (like a pass)."""
    keys = list(loaded.experts)
    rng.shuffle(keys)
    by_layer: dict[int, list[int]] = {}
    for L, e in keys:
        by_layer.setdefault(L, []).append(e)
    total = 0
    t0 = time.perf_counter()
    for L, experts in by_layer.items():
        for i in range(0, len(experts), per_pass):
            batch = experts[i:i + per_pass]
            store.read_many(L, batch)
            total += sum(store.stored_bytes(L, e) for e in batch)
    return total / (time.perf_counter() - t0)


def part_a(args, records):
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.offload.store import ExpertStore

    name = f"olmoe-h{args.hidden}-e{args.experts}k{args.top_k}-i{args.intermediate}-l{args.layers}"
    folder = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        print(f"generating {name} …", file=sys.stderr)
        write_olmoe(folder, args.hidden, args.layers, args.experts, args.top_k, args.intermediate)
    path = os.path.join(folder, "model.safetensors")
    loaded = load_model(folder)
    expert_mib = next(iter(loaded.experts.values())).stored_bytes / 2**20
    params = {"model": name, "expert_mib_stored": round(expert_mib, 3), "file_bytes": os.path.getsize(path)}
    rng = np.random.default_rng(0)
    raw, reads, fetch = [], [], []
    store = ExpertStore(loaded, direct=True, threads=args.threads)
    for _ in range(args.reps):  # interleaved, so drift on this shared machine hits all three alike
        raw.append(raw_direct_read(path) / 1e6)
        reads.append(expert_reads_only(store, loaded, rng, args.threads) / 1e6)
        fetch.append(expert_fetch(store, loaded, rng, args.top_k) / 1e6)
    store.close()
    records += [
        Record("offload", "raw O_DIRECT sequential read (8 MiB requests)", "MB/s", raw, params),
        Record("offload", f"expert reads, store path, no decode ({args.threads} threads)", "MB/s", reads, params),
        Record("offload", "expert reads / raw read", "ratio", [f / r for f, r in zip(reads, raw)], params),
        Record("offload", f"expert fetch incl. fp16→fp32 decode ({args.top_k}/pass, {args.threads} threads)", "MB/s",
               fetch, params),
        Record("offload", "expert fetch incl. decode / raw read", "ratio", [f / r for f, r in zip(fetch, raw)], params),
    ]
    prompt = rng.integers(0, loaded.config.vocab_size - 1, 32)
    speeds = {}
    for budget in ("1.0", "0.5", "0.25", "0.1"):
        samples, hit = [], []
        for _ in range(args.reps):
            engine = build_engine(folder, budget, 32 + args.tokens + 1, loaded=loaded)
            res = generate_ar(engine.model, prompt, args.tokens)
            samples.append(res.decode_tokens_per_s)
            rep = engine.cache.report()["phases"]["ar"]
            hit.append(rep["hit_rate"] or 0.0)
            engine.close()
        speeds[budget] = samples
        records.append(Record("offload", f"AR decode at budget {float(budget):.0%}", "tok/s", samples,
                              {**params, "budget": budget}, {"ar_hit_rate": hit}))
    return records


def part_b(args, records):
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.decoding.generate import generate_ar
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.prompts import default_prompts
    from s2moe.runtime.model.tokenizer import load_tokenizer

    if not (DEFAULT_MODEL / "config.json").exists():
        print("part B skipped: no embedded default model", file=sys.stderr)
        return records
    loaded = load_model(str(DEFAULT_MODEL))
    tok = load_tokenizer(loaded)
    prompts = [tok.encode(p).ids for p in default_prompts()[: args.prompts]]
    for budget in ("0.5", "0.25", "0.1"):
        for policy in ("lru", "lfu"):
            engine = build_engine(str(DEFAULT_MODEL), budget, 1024, policy=policy, loaded=loaded)
            for ids in prompts:  # one cache across prompts, as in a serving session
                generate_ar(engine.model, ids, args.tokens)
            rep = engine.cache.report()["phases"]
            hits = sum(p["hits"] for k, p in rep.items() if k != "load")
            looked = hits + sum(p["misses"] for k, p in rep.items() if k != "load")
            records.append(Record("offload", f"hit rate {policy} at budget {float(budget):.0%}", "fraction",
                                  [hits / looked], {"model": "default-moe", "budget": budget, "policy": policy,
                                                    "prompts": len(prompts), "tokens": args.tokens}))
            engine.close()
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/s2moe-bench")
    ap.add_argument("--skip-policies", action="store_true")
    ap.add_argument("--out", default="docs/results/offload")
    args = ap.parse_args()
    records: list[Record] = []
    part_a(args, records)
    if not args.skip_policies:
        part_b(args, records)
    write_outputs(records, machine_info(), args.out, "expert offloading")


if __name__ == "__main__":
    main()
