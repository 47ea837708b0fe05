"""abenv.py TAG REPS WORKLOAD 'name|ENV=V ...|args' ...: like ab3 but each config may set env vars."""
import json, os, subprocess, sys, statistics
tag, reps, wl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfgs = [(c.split("|")[0], dict(kv.split("=") for kv in c.split("|")[1].split()), c.split("|")[2].split()) for c in sys.argv[4:]]
base = os.environ.get("AB_BASE", "").split()
out = f"/work/scratch/s27/res-{tag}.jsonl"
for r in range(reps):
    for name, env, args in (cfgs if r % 2 == 0 else cfgs[::-1]):
        j = f"/tmp/abenv-{tag}.json"
        cmd = ["s2moe", "bench", "--methods", "ar,s2moe", "-w", wl, "--json", j] + base + args
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env={**os.environ, **env})
        recs = json.load(open(j))["records"]
        ar, s = recs[0], recs[1]
        x = s["extra"]
        row = {"round": r, "name": name, "ar": ar["median"], "s2": s["median"], "ratio": s["median"] / ar["median"],
               "acc": x["acceptance_length"], "ms": x["ms_per_token"], "mb": x["bytes_fetched_per_token"] / 1e6,
               "prefetch": {k: x["prefetch"][k] for k in ("issued", "used", "gated", "wasted", "refused")}}
        open(out, "a").write(json.dumps(row) + "\n")
rows = [json.loads(l) for l in open(out)]
for name, _, _ in cfgs:
    rs = [x for x in rows if x["name"] == name]
    med = lambda k: statistics.median(x[k] for x in rs)
    print(f"{name:8s} n={len(rs)} ratio {med('ratio'):.3f} s2 {med('s2'):.1f} ar {med('ar'):.1f} acc {med('acc'):.2f} mb {med('mb'):.2f} "
          f"ratios {' '.join('%.2f' % x['ratio'] for x in rs)}")
