"""ab3.py TAG REPS WORKLOAD 'name|args' ...: s2moe bench --methods ar,s2moe rounds taking turns (any model/args)."""
import json, os, subprocess, sys, statistics
tag, reps, wl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfgs = [(c.split("|")[0], c.split("|")[1].split()) for c in sys.argv[4:]]
base = os.environ.get("AB_BASE", "").split()
out = f"/work/scratch/s26/res-{tag}.jsonl"
for r in range(reps):
    for name, args in (cfgs if r % 2 == 0 else cfgs[::-1]):
        j = f"/tmp/ab3-{tag}.json"
        cmd = ["s2moe", "bench", "--methods", "ar,s2moe", "-w", wl, "--json", j] + base + args
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        recs = json.load(open(j))["records"]
        ar, s = recs[0], recs[1]
        x = s["extra"]
        row = {"round": r, "name": name, "ar": ar["median"], "s2": s["median"], "ratio": s["median"] / ar["median"],
               "acc": x["acceptance_length"], "ms": x["ms_per_token"], "steps": x["steps"], "trial": x.get("prefetch_trial"),
               "prefetch": {k: x["prefetch"][k] for k in ("issued", "used", "gated")}}
        open(out, "a").write(json.dumps(row) + "\n")
rows = [json.loads(l) for l in open(out)]
for name, _ in cfgs:
    rs = [x for x in rows if x["name"] == name]
    med = lambda k: statistics.median(x[k] for x in rs)
    print(f"{name:8s} n={len(rs)} ratio {med('ratio'):.3f} s2 {med('s2'):.1f} ar {med('ar'):.1f} acc {med('acc'):.2f} "
          f"ratios {' '.join('%.2f' % x['ratio'] for x in rs)}")
