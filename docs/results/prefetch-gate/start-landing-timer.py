import sys, time, atexit, collections, statistics
sys.path.insert(0, '/work/main')
from s2moe.runtime.offload import store as st
W = []; C = []
_init = st.NativeFetch.__init__
def init(self, *a):
    t0 = time.perf_counter(); _init(self, *a); t1 = time.perf_counter(); C.append(t1 - t0); self._t0 = t0
st.NativeFetch.__init__ = init
_res = st.NativeFetch.result
def res(self):
    r = _res(self)
    if getattr(self, "_t0", None) is not None and self.done_at:
        W.append(self.done_at - self._t0); self._t0 = None
    return r
st.NativeFetch.result = res
@atexit.register
def rep():
    q = lambda a, p: sorted(a)[int(p * (len(a) - 1))] * 1e6
    print("fetches", len(C), "issue us med", round(q(C, .5), 1), "p90", round(q(C, .9), 1), "| wall us med", round(q(W, .5), 1), "p10", round(q(W, .1), 1), "p90", round(q(W, .9), 1), "ratio med", round(q(W, .5) / q(C, .5), 1), file=sys.stderr)
sys.argv = ["s2moe"] + sys.argv[1:]
from s2moe.runtime.cli import main
main()
