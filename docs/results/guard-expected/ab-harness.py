"""The A/B harness of these records (session 23, scratch): abe.py alternates `s2moe bench --methods ar,s2moe`
configurations round by round (reversed order on odd rounds) and appends one JSON row per run; cli_q.py is
the entry it runs, with the patches the configurations name in their environment: OLDGUARD (the guard's
observe without AE's expectation, as before f9670eb), HEADFROMCACHE (a draft head taken from a share
budget's expert room, as 22547b7 then made the product do), QHEAD (a quantised full-vocabulary draft head), KOFF."""

# ---- abe.py ----
"""abe.py TAG REPS WORKLOAD 'name|ENV=V,ENV2=V|args' ... : alternating s2moe bench ar,s2moe rounds."""
import json, os, subprocess, sys, statistics
tag, reps, wl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfgs = []
for c in sys.argv[4:]:
    name, env, args = c.split("|")
    e = dict(os.environ); [e.__setitem__(*kv.split("=", 1)) for kv in env.split(",") if kv]
    cfgs.append((name, e, args.split()))
out = f"/work/scratch/s23/res-{tag}.jsonl"
for r in range(reps):
    for name, env, args in (cfgs if r % 2 == 0 else cfgs[::-1]):
        j = f"/tmp/abe-{tag}.json"
        cmd = [sys.executable, "/work/scratch/s23/cli_q.py", "bench", "--methods", "ar,s2moe", "-b", os.environ.get("ABE_BUDGET", "0.25"), "-w", wl,
               "--n-prompts", "6", "--json", j] + args
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        recs = json.load(open(j))["records"]
        ar, s = recs[0], recs[1]
        x = s["extra"]
        row = {"round": r, "name": name, "ar": ar["median"], "s2": s["median"], "ratio": s["median"] / ar["median"],
               "acc": x["acceptance_length"], "ms": x["ms_per_token"], "steps": x["steps"],
               "cov": x.get("draft_vocab_coverage"), "guard": x.get("rate_guard")}
        open(out, "a").write(json.dumps(row) + "\n")
rows = [json.loads(l) for l in open(out)]
for name, _, _ in cfgs:
    rs = [x for x in rows if x["name"] == name]
    med = lambda k: statistics.median(x[k] for x in rs)
    print(f"{name:12s} n={len(rs)} ratio {med('ratio'):.3f} s2 {med('s2'):.0f} ar {med('ar'):.0f} acc {med('acc'):.2f} "
          f"draft {statistics.median(x['ms']['draft_compute'] for x in rs):.3f} total {statistics.median(x['ms']['total'] for x in rs):.3f} "
          f"ratios {' '.join('%.2f' % x['ratio'] for x in rs)}")

# ---- cli_q.py ----
import sys, os
sys.path.insert(0, '/work/scratch/s23')
if os.environ.get("QHEAD"): import qhead  # noqa
if os.environ.get("KOFF"):
    from s2moe import _cpu; _cpu.io_kernel(0)
if os.environ.get("OLDGUARD"):
    from s2moe.runtime.decoding import rate_guard as _rg
    _o = _rg.RateGuard.observe
    _rg.RateGuard.observe = lambda self, sp, tok, sec, expected=None: _o(self, sp, tok, sec, None)
if os.environ.get("HEADFROMCACHE"):
    from s2moe.runtime.offload import memory as _mem
    _pm = _mem.plan_memory
    def _plan(*a, **k):
        p = _pm(*a, **k)
        h = k.get("draft_head", 0)
        if h and a[1].share is not None:
            import dataclasses
            p = dataclasses.replace(p, expert_capacity=max(0, p.expert_capacity - h))
        return p
    _mem.plan_memory = _plan
    import s2moe.runtime.engine as _eng
    _eng.plan_memory = _plan
from s2moe.runtime.cli import main
sys.argv = ['s2moe'] + sys.argv[1:]
main()

# ---- qhead.py (QHEAD) ----
"""Prototype: a quantized full-vocab draft head (env QHEAD=Q8_0|Q4_0), patched into MoEModel.draft_head."""
import os, numpy as np
from s2moe.runtime.model import forward as F
from s2moe.runtime.model.draft_head import DraftHead
from s2moe.runtime.kernels.stored import StoredMatrix
Q = os.environ.get("QHEAD")
orig = F.MoEModel.draft_head
def draft_head(self, n, ranks_path=None):
    if not Q: return orig(self, n, ranks_path)
    key = ("q", Q)
    if key not in self._draft_heads:
        W = self.W["lm_head"]
        V = self.config.vocab_size
        ids = np.arange(V) if n >= 5957 else orig(self, n, ranks_path).ids
        f = W.dequantize(ids)
        self._draft_heads[key] = DraftHead(ids, StoredMatrix.from_float(f, Q), V)
    return self._draft_heads[key]
F.MoEModel.draft_head = draft_head
