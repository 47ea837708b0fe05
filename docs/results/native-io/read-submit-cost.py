"""Scratch instrument of session 23: the `_cpu.Read` constructor timed in place over `bench` runs (ar,s2moe, HumanEval, 25 %). KOFF=1 and the `kernel` attribute need kernel-aio-not-kept.patch; without the patch drop those two lines."""
import sys, time, statistics, os
sys.path.insert(0, '/work/main')
from benchmarks.in_process import bench_records
from s2moe.runtime.offload import store
from s2moe import _cpu
if os.environ.get("KOFF"): _cpu.io_kernel(0)
print("kernel", _cpu.io_kernel())
orig = store._NativeRead
ts = []; K = []
class Timed:
    def __new__(cls, *a):
        t = time.perf_counter(); r = orig(*a); ts.append(time.perf_counter() - t); K.append(r.kernel); return r
store._NativeRead = Timed
for i in range(3):
    ts.clear()
    recs = bench_records("ar,s2moe", "0.25", "humaneval", None, ["--no-rate-guard"])
    print(f"reads {len(ts)} median {statistics.median(ts)*1e6:.1f} us mean {statistics.mean(ts)*1e6:.1f} us p90 {sorted(ts)[int(.9*len(ts))]*1e6:.1f} total {sum(ts)*1e3:.1f} ms; ar {recs[0]['median']:.0f} s2 {recs[1]['median']:.0f}")
