"""What expert reads beside it cost a decode pass: Python fetch threads against the extension's I/O
threads (`_cpu.Read`, csrc/cpu/aio.c), on the embedded default model at a 25 % budget, taking
turns in one process (this machine drifts by tens of percent within seconds).

    python benchmarks/fetch_threads.py [--reps 7] [--out docs/results/fetch-threads]

Rows (median ms per draft pass over ``--reps`` rounds of 100 passes each):
- a draft pass (resident experts only) alone;
- the same pass while a Python thread reads experts (``ExpertStore.read``) several hundred times
  a second, and while a Python thread only wakes that often (no read: the GIL hand-over alone);
- a six-token `ca` draft chain with draft-guided prefetch off, on with Python fetch threads, and
  on with native reads (the draft phase timed; the guesses' reads are settled after it, untimed,
  and the cache put back as it was, so every round guesses the same misses).
Results: a markdown table on stdout, JSON/CSV under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.runtime.cli.common import DEFAULT_MODEL  # noqa: E402
from s2moe.runtime.decoding.cost_model import CostConstants  # noqa: E402
from s2moe.runtime.decoding.methods import SpecSettings, get_method  # noqa: E402
from s2moe.runtime.decoding.sampling import draws_for  # noqa: E402
from s2moe.runtime.decoding.speculative import SpeculativeDecoder  # noqa: E402
from s2moe.runtime.engine import build_engine, phase_of  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


class Background:
    """A loop on its own Python thread: ``kind`` "python" reads an expert with `ExpertStore.read`,
    "wake" only wakes up; then it sleeps ``gap`` seconds."""

    def __init__(self, store, kind: str, gap: float = 0.0012):
        self.store, self.kind, self.gap, self.count = store, kind, gap, 0
        self.keys = sorted(store.refs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        rng = random.Random(0)
        while not self._stop.is_set():
            key = rng.choice(self.keys)
            if self.kind == "python":
                self.store.read(*key)
            self.count += 1
            time.sleep(self.gap)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self.t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--passes", type=int, default=240)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    engine = build_engine(str(DEFAULT_MODEL), budget="0.25")
    model, store, cache = engine.model, engine.cache.store, engine.cache
    if not store.native:
        sys.exit("the extension's I/O threads are not available here (is s2moe._cpu built?)")
    costs = CostConstants(t_ar=0.01, c_draft=0.001, t_exp_miss=0.0005, t_exp_hit=0.0001)
    decoder = SpeculativeDecoder(model, get_method("ca"), SpecSettings(draft_topk=2), costs)
    prompt = list(range(100, 260))  # a 160-token context
    kv = model.new_cache(512)
    model.forward(prompt, kv, logits="last")
    kv.commit(len(prompt))
    P = kv.length
    draws = draws_for(decoder.params)
    slots = cache.prefetch_slots

    def draft_pass():
        with phase_of(model, "draft"):
            model.forward([7], kv, policy=decoder.draft_policy, logits="last")
        kv.rollback(P)

    def chain(prefetch: bool, native: bool) -> float:
        """Seconds of one draft phase (root and chain); the guesses' reads are settled after,
        untimed, as verification would use them."""
        cache.prefetch_slots, store.native = (slots if prefetch else 0), native
        held = dict(cache.held)
        t0 = time.perf_counter()
        with phase_of(model, "draft"):
            logits, experts = decoder._draft_root([7], kv)
            decoder._draft_chain(kv, draws, 0, 6, logits, experts)
        took = time.perf_counter() - t0
        kv.rollback(P)
        cache.settle_prefetches()
        for key in set(cache.held) - set(held):  # the cache as it was: the same misses to guess next time
            cache.policy.remove(key)
            cache._drop(key)
        for key in set(held) - set(cache.held):
            cache.hold(key, held[key])
        store.native = True
        return took

    def timed(fn, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    def chained(prefetch: bool, native: bool, n: int) -> float:
        return sum(chain(prefetch, native) for _ in range(n)) / (6 * n) * 1e3

    cases = {
        "draft pass, alone": lambda: timed(draft_pass, a.passes),
        "draft pass, reads on a Python thread": ("python", lambda: timed(draft_pass, a.passes)),
        "draft pass, a Python thread only waking": ("wake", lambda: timed(draft_pass, a.passes)),
        "6-token draft chain, prefetch off": lambda: chained(False, True, a.passes // 6),
        "6-token draft chain, prefetch on Python threads": lambda: chained(True, False, a.passes // 6),
        "6-token draft chain, prefetch native": lambda: chained(True, True, a.passes // 6),
    }
    samples = {name: [] for name in cases}
    rates = {name: [] for name in cases}
    for _ in range(2):  # warm-up, untimed
        draft_pass()
        chain(True, True)
    for _ in range(a.reps):
        for name, case in cases.items():
            if isinstance(case, tuple):
                with Background(store, case[0]) as bg:
                    samples[name].append(case[1]())
                rates[name].append(bg.rate)
            else:
                samples[name].append(case())
    info = machine_info()
    records = [Record("fetch_threads", name, "ms", samples[name],
                      params={"model": "embedded default", "budget": "0.25", "passes": a.passes,
                              "background_per_s": round(statistics.median(rates[name]), 1) if rates[name] else None})
               for name in cases]
    base = statistics.median(samples["draft pass, alone"])
    print(f"| case | ms per draft pass (median of {a.reps}) | vs alone | background wakes/s |")
    print("|---|---|---|---|")
    for r in records:
        med = statistics.median(r.samples)
        print(f"| {r.name} | {med:.3f} | {med / base:.2f}× | {r.params['background_per_s'] or '–'} |")
    print(f"\nmachine: {info.get('cpu_model', '?')}, commit {records[0].commit}")
    if a.out:
        write_outputs(records, info, a.out, "draft pass beside expert reads")


if __name__ == "__main__":
    main()
