"""How many reads a better expert cache could save: a recorded run replayed through the cache's own
policies and through Belady's MIN, which knows the future.

    s2moe bench --methods ar,s2moe -m WIDENED -b 0.25 -w humaneval --n-prompts 3 --trace T.json
    python benchmarks/cache_ceiling.py T.json --capacity 32 [--expert-mib 3] [--out STEM]

A trace (`decoding/trace.py`) holds every pass's experts in request order. Each method's passes are
replayed through a cache of ``--capacity`` experts (the run's expert budget over one expert's size;
the widened model at 25 % holds 32). Prefill, AR and verification passes read what is absent;
draft passes are resident-only, so they read nothing (they still count as uses). The cache is
replayed three ways:
- the runtime's own policies (`offload/policies.py`: LFU with decay, the default, and LRU), with
  the runtime's admission rule. This replay checks itself against the reads the run measured;
- MIN with bypass: on a miss in a full cache it keeps the experts whose next read comes soonest
  and streams the new one if it is the one needed last. It may evict what its own pass has already
  used (the runtime keeps a pass's experts to its end). It is the clairvoyant rule, a bound no
  online policy is expected to beat.

Routing is held as recorded. A cache that held other experts would change what the draft can use
and what gating favours, so MIN bounds what a policy could save on these passes, not on the passes
it would cause. Prints reads and MB per generated token (prefill's left out, as `s2moe bench`
leaves them out), and with ``--out`` writes them as records (.json / .csv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from bisect import bisect_right
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s2moe.runtime.offload.policies import POLICIES, DecayedLFU  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402

READS = ("ar", "verify")  # passes whose reads count per token (prefill's do not, as in s2moe bench)


class _AdmitAll(DecayedLFU):
    """The default LFU without its admission filter: every read is kept, evicting the coldest."""

    def admit(self, key, victim, coming: bool = False) -> bool:
        return True


VARIANTS = {  # --variants: simple online changes to the default policy
    "lfu, half-life 32": lambda: DecayedLFU(half_life=32),
    "lfu, half-life 128": lambda: DecayedLFU(half_life=128),
    "lfu, half-life 2048": lambda: DecayedLFU(half_life=2048),
    "lfu, no decay": lambda: DecayedLFU(half_life=float("inf")),
    "lfu, every read admitted": _AdmitAll,
}


def replay_policy(passes, capacity: int, make) -> dict:
    """Reads per phase through the policy ``make()`` (e.g. `POLICIES["lfu"]`), as `ExpertCache`
    admits and evicts."""
    policy, held, reads = make(), set(), defaultdict(int)
    for phase, _, keys in passes:
        protected = set(keys)
        for key in keys:
            if key in held:
                policy.touch(key)
                continue
            policy.access(key)
            if phase == "draft":  # resident-only: an absent expert is not read
                continue
            reads[phase] += 1
            while len(held) >= capacity:
                victim = policy.victim(protected)
                if victim is None or not policy.admit(key, victim):
                    break
                policy.remove(victim)
                held.discard(victim)
            if len(held) < capacity:
                held.add(key)
                policy.insert(key)
    return reads


def replay_min(passes, capacity: int) -> dict:
    """Reads per phase under Belady's MIN with bypass: the next read of each expert is known."""
    uses: dict = defaultdict(list)  # expert -> indices of the passes that read it (not drafts)
    for t, (phase, _, keys) in enumerate(passes):
        if phase != "draft":
            for key in keys:
                uses[key].append(t)

    def next_read(key, t: int) -> float:
        i = bisect_right(uses[key], t)
        return uses[key][i] if i < len(uses[key]) else float("inf")

    held, reads = set(), defaultdict(int)
    for t, (phase, _, keys) in enumerate(passes):
        if phase == "draft":
            continue
        for i, key in enumerate(keys):
            if key in held:
                continue
            protected = set(keys[i + 1:])  # what this pass still asks for (the rest it has used)
            reads[phase] += 1
            if len(held) < capacity:
                held.add(key)
                continue
            candidates = [k for k in held if k not in protected]
            if not candidates:
                continue
            farthest = max(candidates, key=lambda k: next_read(k, t))
            if next_read(farthest, t) > next_read(key, t):
                held.discard(farthest)
                held.add(key)
    return reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--capacity", type=int, required=True, help="experts the cache holds")
    ap.add_argument("--expert-mib", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="output stem for the records")
    ap.add_argument("--variants", action="store_true", help="also replay simple variants of the default LFU")
    args = ap.parse_args()
    records = []
    data = json.load(open(args.trace))
    E = data["model"]["experts_per_layer"]
    mb = args.expert_mib * 2**20 / 1e6
    print(f"{args.trace}: budget {data['recorded']['budget']}, {args.capacity} experts of {args.expert_mib} MiB")
    print("| method | replay | reads a token | MB a token | against the runtime's LFU |")
    print("|---|---|---|---|---|")
    for run in data["runs"]:
        passes = [(phase, n, [(k // E, k % E) for k in keys]) for phase, n, keys in run["passes"]]
        tokens = max(run["tokens"], 1)
        got = {f"runtime {name}": replay_policy(passes, args.capacity, POLICIES[name]) for name in ("lfu", "lru")}
        if args.variants:
            got.update({label: replay_policy(passes, args.capacity, make) for label, make in VARIANTS.items()})
        got["MIN (knows the future)"] = replay_min(passes, args.capacity)
        base = sum(got["runtime lfu"][p] for p in READS)
        for label, reads in got.items():
            n = sum(reads[p] for p in READS)
            print(f"| {run['method']} | {label} | {n / tokens:.2f} | {n / tokens * mb:.2f} | {n / base:.2f}× |")
            records.append(Record("cache-ceiling", f"{run['method']} {label}", "reads/token", [n / tokens],
                                  params={"trace": args.trace, "budget": data["recorded"]["budget"],
                                          "capacity": args.capacity, "expert_mib": args.expert_mib,
                                          "method": run["method"], "replay": label},
                                  extra={"mb_per_token": n / tokens * mb, "over_runtime_lfu": n / base,
                                         "reads_by_phase": dict(reads), "tokens": run["tokens"]}))
    if args.out:
        write_outputs(records, machine_info(), args.out, "reads a token: the runtime's cache against MIN")


if __name__ == "__main__":
    main()
