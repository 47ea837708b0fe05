"""abe.py TAG REPS WORKLOAD 'name|ENV=V,ENV2=V|args' ... : alternating s2moe bench ar,s2moe rounds."""
import json, os, subprocess, sys, statistics
tag, reps, wl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfgs = []
for c in sys.argv[4:]:
    name, env, args = c.split("|")
    e = dict(os.environ); [e.__setitem__(*kv.split("=", 1)) for kv in env.split(",") if kv]
    cfgs.append((name, e, args.split()))
out = f"/work/scratch/s25/res-{tag}.jsonl"
for r in range(reps):
    for name, env, args in (cfgs if r % 2 == 0 else cfgs[::-1]):
        j = f"/tmp/abe-{tag}.json"
        cmd = [sys.executable, os.environ.get("ABE_CLI", "/work/scratch/s23/cli_q.py"), "bench", "--methods", "ar,s2moe", "-b", os.environ.get("ABE_BUDGET", "0.25"), "-w", wl,
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
