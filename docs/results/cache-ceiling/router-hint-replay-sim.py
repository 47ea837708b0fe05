
# -- part 2 (hint_sim.py, run as: python router-hint-replay-sim.py 32|12) --
import sys, pickle, numpy as np
from collections import defaultdict
from bisect import bisect_right
sys.path.insert(0, "/work/main")
from s2moe.runtime.offload.policies import DecayedLFU
steps = pickle.load(open("/work/scratch/s28/ar_steps.pkl", "rb"))
CAP = int(sys.argv[1]) if len(sys.argv) > 1 else 32

def sim(seq, beta, hl=512.0, admit_filter=True):
    pol = DecayedLFU(half_life=hl); held = set(); reads = 0; hint = {}
    for row in seq:
        for L in sorted(row):
            chosen, pr = row[L]
            keys = [(L, e) for e in chosen]
            protected = set(keys)
            for key in keys:
                if key in held:
                    pol.touch(key); continue
                pol.access(key); reads += 1
                if len(held) >= CAP:
                    comb = lambda k: pol._score(k) + beta * hint.get(k, 0.0)
                    cands = [k for k in held if k not in protected]
                    if cands:
                        v = min(cands, key=comb)
                        if (not admit_filter) or comb(key) > comb(v):
                            held.discard(v); pol.remove(v)
                if len(held) < CAP:
                    held.add(key); pol.insert(key)
            for e in range(len(pr)):  # this token's router probabilities: the hint for the next token
                hint[(L, e)] = float(pr[e])
    return reads

def mins(seq):
    flat = []
    for t, row in enumerate(seq):
        for L in sorted(row):
            flat.append([(L, e) for e in row[L][0]])
    uses = defaultdict(list)
    for i, ks in enumerate(flat):
        for k in ks: uses[k].append(i)
    nxt = lambda k, i: (uses[k][bisect_right(uses[k], i)] if bisect_right(uses[k], i) < len(uses[k]) else 1e18)
    held = set(); reads = 0
    for i, ks in enumerate(flat):
        for j, k in enumerate(ks):
            if k in held: continue
            reads += 1
            if len(held) < CAP: held.add(k); continue
            prot = set(ks[j+1:])
            c = [x for x in held if x not in prot]
            f = max(c, key=lambda x: nxt(x, i))
            if nxt(f, i) > nxt(k, i): held.discard(f); held.add(k)
    return reads

for wl in ("humaneval", "gsm8k", "mt-bench"):
    seq = [row for w, row in steps if w == wl]
    base = sim(seq, 0.0)
    out = {f"b={b}": round(sim(seq, b) / base, 3) for b in (0.5, 1, 2, 4, 8, 16)}
    out["MIN"] = round(mins(seq) / base, 3)
    print(wl, "lfu reads/token", round(base / len(seq), 2), out)
