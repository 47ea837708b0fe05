"""A scratch replay kept as the record of how the figures in s2moe-targets.md ("Could a better expert
cache read less?") were taken; not a tool. Part 1: greedy AR on the widened model, every expert
resident, 3 prompts x 64 tokens per workload, each token's router probabilities. Part 2 replays them."""
import sys, json, numpy as np
from collections import defaultdict
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from s2moe.runtime.engine import build_engine
from s2moe.runtime.model.tokenizer import load_tokenizer
from s2moe.runtime.bench import resolve_workload
from s2moe.runtime.prompts import load_workload
from s2moe.runtime.offload.policies import DecayedLFU
import cache_ceiling as cc

eng = build_engine("/work/models/widened", None, 1024)
m = eng.model; c = m.config
tok = load_tokenizer(eng.loaded)
steps = []  # per token: {L: (chosen list, probs array)}
for wl in ("humaneval", "gsm8k", "mt-bench"):
  for p in load_workload(resolve_workload(wl))[:3]:
    ids = tok.encode(p).ids[-512:]
    kv = m.new_cache(len(ids) + 70)
    logits, _ = m.forward(ids, kv, logits="last"); kv.commit(kv.filled)
    t = int(logits[-1].argmax())
    for _ in range(64):
        logits, rec = m.forward([t], kv, logits="last"); kv.commit(kv.filled)
        row = {}
        for L, lr in rec.layers.items():
            lg = np.asarray(lr.logits[0], np.float64); pr = np.exp(lg - lg.max()); pr /= pr.sum()
            row[L] = ([int(e) for e in lr.experts[0] if e >= 0], pr)
        steps.append((wl, row))
        t = int(logits[-1].argmax())
import pickle; pickle.dump(steps, open("/work/scratch/s28/ar_steps.pkl", "wb"))
print(len(steps))
