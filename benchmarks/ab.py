"""Backs docs/performance/s2moe-prefetch.md, "Prefetch on every iteration by default" (and the other
A/Bs the notes quote, e.g. docs/performance/live-costs.md, "Live decisions against a profile held
still"): two settings or revisions of s2moe, taking turns. A user-facing tool as well.

Two settings of `s2moe bench` on the same prompts, taking turns: the paired ratio B / A.

    python benchmarks/ab.py --label prefetch --a=--no-prefetch --b= --reps 5 --out docs/results/prefetch \
        -- --model WIDENED --methods s2moe --budget 0.25 -w humaneval --n-prompts 3
    python benchmarks/ab.py --label live-vs-stale --a=--no-live-costs --b= --reps 3 --out docs/results/live \
        -- --model WIDENED --methods s2moe --profile P.json --emulate-bandwidth 200 --emulate-latency 300

With ``--run`` each side is one `s2moe run --json` (the main job, with its model's sampling
defaults), and the figure is the decode tok/s it reports:

    python benchmarks/ab.py --run --label sampling --a-rev OLD --b-rev NEW --reps 6 --out OUT \
        -- -f PROMPT.txt -n 256 --ignore-eos --budget 0.25

Everything after ``--`` goes to both runs; ``--a`` and ``--b`` add each side's own flags (split
like a shell line), and ``--a-rev`` / ``--b-rev`` run that side on the code of a git revision (a
clean copy with the built extension, or one built from its own sources where its kernels
differ, first on its import path) instead of the installed one:

    python benchmarks/ab.py --label reads-first --a-name before --a-rev b247cfd --b-name after \
        --out docs/results/read-overlap/widened-0.25 \
        -- --model WIDENED --methods ar,s2moe --budget 0.25 -w humaneval --n-prompts 3

A repetition runs A then B, the next B then A, and so on: this machine drifts by tens of percent
within seconds, so only ratios within a repetition mean anything. For each method the figure is
B's aggregate decode tok/s over A's, per repetition, with the median.

A change that should only move timing is compared with the run's own timed decisions held still:
AE's constants from a profile and fixed, hence no rate guard and no prefetch trial, and prefetch off.
Live runs of one setting on three prompts had acceptance lengths of 3.7 to 6.0 and ran at 97 to
150 tok/s; held still, three runs took the same steps and ran within 3 % of each other
(docs/performance/s2moe-prefetch.md, "Reading a layer ahead inside verification"):

    python benchmarks/ab.py --label X --a=... --b=... --reps 5 --out OUT \
        -- --model WIDENED --methods s2moe --budget 0.25 --profile P --no-live-costs --no-prefetch

The table then says whether both sides took the same steps (drafted, accepted, verifications) in
every repetition: if they did, the ratio is timing alone.

Writes ``--out``.json / .csv (raw samples, acceptance, MB fetched per token, the constants each run
ended with, machine, commit) and prints a markdown table. Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Record, machine_info, rounds, write_outputs  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); runpy.run_module('s2moe.runtime.cli', run_name='__main__')"


def copy_of(rev: str, dest: str) -> str:
    """A clean tree of ``rev`` importable as s2moe, with this checkout's built extension, or its
    own when ``rev``'s kernel sources differ from the working tree's (else an A/B of a kernel
    change would time one extension twice)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import mutate  # its make_copy: the same copies mutation testing and the stress loop use

    os.makedirs(dest)
    mutate.make_copy(rev, dest)
    same = subprocess.run(["git", "diff", "--quiet", rev, "--", "csrc/cpu", "setup.py"], cwd=ROOT).returncode == 0
    if not same:
        print(f"building {rev}'s CPU kernels for its side", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True,
                       stdout=subprocess.DEVNULL)
    return dest


def s2moe(command: str, args: list[str], own: list[str], code: str | None) -> str:
    """`s2moe COMMAND` on the code under ``code`` (or the installed one); its stdout, or exit with
    its last stderr line."""
    head = [sys.executable, "-c", CLI, code] if code else [sys.executable, "-m", "s2moe.runtime.cli"]
    done = subprocess.run([*head, command, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: s2moe {command} {shlex.join(own)} exited {done.returncode}: "
                         + (done.stderr.strip().splitlines() or ["no message"])[-1])
    return done.stdout


def bench_once(common: list[str], own: list[str], code: str | None) -> dict[str, dict]:
    """One `s2moe bench`: records by method."""
    with tempfile.TemporaryDirectory(prefix="s2moe-ab-") as tmp:
        out = os.path.join(tmp, "bench.json")
        s2moe("bench", [*common, *own, "--json", out], own, code)
        with open(out, encoding="utf-8") as f:
            return {r["name"]: r for r in json.load(f)["records"]}


def run_once(common: list[str], own: list[str], code: str | None) -> dict[str, dict]:
    """One `s2moe run --json` (the main job, decode time as a user sees it): a bench-like record."""
    st = json.loads(s2moe("run", [*common, *own, "--json"], own, code))["stats"]
    extra = {"decode_tokens_per_s_aggregate": st["decode_tokens_per_s"], "acceptance_length": st["acceptance_length"],
             "bytes_fetched_per_token": st.get("bytes_fetched_per_token") or 0,
             "live_costs": (st.get("live_costs") or {}).get("constants"), "cost_constants": st.get("cost_constants"),
             "rate_guard": (st.get("live_costs") or {}).get("rate_guard")}
    params = {"workload": "run", "budget": (st.get("offload") or {}).get("budget"), "n_prompts": 1, "emulation": None}
    return {st["method"]: {"name": st["method"], "params": params, "extra": extra}}


def tok_s(record: dict) -> float:
    """A run's aggregate decode tok/s: all prompts' tokens over all their time."""
    return float(record["extra"]["decode_tokens_per_s_aggregate"])


def main() -> None:
    argv = sys.argv[1:]
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="what is compared (names the records)")
    ap.add_argument("--a", default="", help="side A's own flags")
    ap.add_argument("--b", default="", help="side B's own flags")
    ap.add_argument("--a-name", default="A")
    ap.add_argument("--b-name", default="B")
    ap.add_argument("--a-rev", help="run side A on this git revision's code")
    ap.add_argument("--b-rev", help="run side B on this git revision's code")
    ap.add_argument("--run", action="store_true", help="time `s2moe run` (the main job, one prompt, its decode "
                    "tok/s as it reports them) instead of `s2moe bench`")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="output stem (.json and .csv are added)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.reps < 1 or args.a_name == args.b_name:
        raise SystemExit("error: --reps must be at least 1 and the two sides need different names")
    sides = {args.a_name: shlex.split(args.a), args.b_name: shlex.split(args.b)}
    runs: dict[str, list[dict[str, dict]]] = {name: [] for name in sides}
    scratch = tempfile.mkdtemp(prefix="s2moe-ab-code-")
    try:
        code = {name: copy_of(rev, os.path.join(scratch, name)) if rev else None
                for name, rev in ((args.a_name, args.a_rev), (args.b_name, args.b_rev))}
        for rep, name in rounds(sides, args.reps, reverse=True):
            runs[name].append((run_once if args.run else bench_once)(common, sides[name], code[name]))
            print(f"rep {rep + 1} {name}: " + ", ".join(f"{m} {tok_s(r):.2f} tok/s"
                                                        for m, r in runs[name][-1].items()), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    a, b = args.a_name, args.b_name
    methods = list(runs[a][0])
    records, rows = [], []
    for method in methods:
        ratios = [tok_s(rb[method]) / tok_s(ra[method]) for ra, rb in zip(runs[a], runs[b])]
        for name in (a, b):
            recs = [r[method] for r in runs[name]]
            records.append(Record(
                "ab", f"{args.label} {name} {method}", "tok/s", [tok_s(r) for r in recs],
                params={"label": args.label, "side": name, "flags": sides[name], "common": common, "method": method,
                        "code": {args.a_name: args.a_rev, args.b_name: args.b_rev}[name] or "installed",
                        **{k: recs[0]["params"].get(k) for k in ("workload", "budget", "n_prompts", "emulation")}},
                extra={"acceptance_length": [r["extra"].get("acceptance_length") for r in recs],
                       "mb_fetched_per_token": [r["extra"].get("bytes_fetched_per_token", 0) / 1e6 for r in recs],
                       "ms_per_token": [r["extra"].get("ms_per_token") for r in recs],
                       "prefetch": [r["extra"].get("prefetch") for r in recs],
                       "steps": [r["extra"].get("steps") for r in recs],
                       "rate_guard": [r["extra"].get("rate_guard") for r in recs],
                       "constants_at_end": [r["extra"].get("live_costs") or r["extra"].get("cost_constants")
                                            for r in recs],
                       f"{b}_over_{a}": ratios if name == b else None}))
        same = all(ra[method]["extra"].get("steps") == rb[method]["extra"].get("steps")
                   for ra, rb in zip(runs[a], runs[b]))  # the same decisions: the ratio is timing alone
        rows.append((method, [tok_s(r[method]) for r in runs[a]], [tok_s(r[method]) for r in runs[b]], ratios, same))
    write_outputs(records, machine_info(), args.out, f"{args.label}: {b} against {a}")
    print(f"| method | {a} tok/s | {b} tok/s | {b} / {a}, each repetition | median | same steps |")
    print("|---|---|---|---|---|---|")
    for method, sa, sb, ratios, same in rows:
        print(f"| {method} | {', '.join(f'{x:.2f}' for x in sa)} | {', '.join(f'{x:.2f}' for x in sb)} | "
              f"{', '.join(f'{x:.3f}' for x in ratios)} | **{statistics.median(ratios):.3f}×** | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
