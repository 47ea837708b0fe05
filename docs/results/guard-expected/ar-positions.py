"""Scratch instrument of session 23: the misses of each AR step of the AR method and of an S²-MoE run, by text position (greedy runs emit the same tokens), so the AR steps S²-MoE took can be compared with the AR method's steps at the same positions."""
"""AR steps inside S²-MoE runs miss more than the AR method's: selection (the tokens AE declines) or
cache state? Misses of the AR method's step at the same positions (greedy: same tokens)."""
import sys, statistics, collections
sys.path.insert(0, '/work/main')
from benchmarks.in_process import bench_records
from s2moe.runtime.decoding import speculative as S
log = collections.defaultdict(list)   # method -> list per prompt of {position: misses}
orig_gen = S.SpeculativeDecoder.generate
orig_fwd = None
def gen(self, prompt, max_tokens, *a, **k):
    cur = {}
    self._arpos = cur
    r = orig_gen(self, prompt, max_tokens, *a, **k)
    log[self.method.name].append(cur)
    return r
S.SpeculativeDecoder.generate = gen
# record each AR step's misses by the text position: wrap metrics.ar_samples append via a list subclass
class Rec(list):
    def __init__(self, dec): super().__init__(); self.dec = dec
    def append(self, x):
        super().append(x)
        d = self.dec
        d._arpos[len(d._arpos_out)] = x[1]
orig_init = S.SpecMetrics.__init__ if hasattr(S, "SpecMetrics") else None
wl = sys.argv[1]; extra = sys.argv[2:]
# simpler: patch emit position through kv length: P = kv.length at the step == prompt + len(out) - 1
orig_forward_holder = {}
import s2moe.runtime.model.forward as F
of = F.MoEModel.forward
cur_dec = [None]
def gen2(self, prompt, max_tokens, *a, **k):
    cur_dec[0] = (self, len(list(prompt)))
    return gen(self, prompt, max_tokens, *a, **k)
S.SpeculativeDecoder.generate = gen2
def fwd(self, tokens, kv, *a, **k):
    out = of(self, tokens, kv, *a, **k)
    return out
# use ar_samples order + positions via kv: wrap the AR branch: model.forward with record=False and len(tokens)==1 and policy default
import s2moe.runtime.decoding.speculative as SP
real_forward = F.MoEModel.forward
def fwd_pos(self, tokens, kv, start=None, policy=SP.TARGET if hasattr(SP, "TARGET") else None, logits="all", record=True, **k):
    d = cur_dec[0]
    if d is not None and record is False and logits == "last" and len(tokens) == 1 and kv.filled > d[1]:
        st = d[0].cache.stats["ar"]
        before = st.misses
        out = real_forward(self, tokens, kv, start=start, **({} if policy is None else {"policy": policy}), logits=logits, record=record, **k)
        d[0]._arpos[kv.filled - 1] = st.misses - before
        return out
    return real_forward(self, tokens, kv, start=start, **({} if policy is None else {"policy": policy}), logits=logits, record=record, **k)
F.MoEModel.forward = fwd_pos
for rep in range(2):
    log.clear()
    bench_records("ar,s2moe", "0.25", wl, None, list(extra))
    ar, sp = log["ar"][1:], log["s2moe"][1:]   # [0]: the warm-up
    same_ar, same_sp, all_ar = [], [], []
    for a, s in zip(ar, sp):
        all_ar.extend(a.values())
        for pos, m in s.items():
            if pos in a:
                same_ar.append(a[pos]); same_sp.append(m)
    print(f"{wl}: AR method {statistics.mean(all_ar):.2f} misses/step over {len(all_ar)}; at S2-MoE's {len(same_sp)} AR positions: "
          f"AR method {statistics.mean(same_ar):.2f}, S2-MoE {statistics.mean(same_sp):.2f}")
