"""Mutation testing: inject known bugs one at a time into a scratch copy and check the suite fails.

Each mutation replaces one exact snippet of one file (the snippet must occur exactly once, else the
mutation is reported as ``stale``: the code moved, update the list) and runs pytest on the tests
most likely to catch it (``--full``: the whole suite). A mutation is ``caught`` when pytest fails
(or errors, or times out), ``survived`` when it passes. The repository itself is never touched:
the copy lives under a temporary folder, importable as ``s2moe`` through a small shim
(``s2moe/runtime`` → ``runtime/`` and so on, as pyproject's package-dir maps them) on PYTHONPATH.
A mutation of the CPU kernels (``csrc/cpu/``) rebuilds the copy's extension before its tests and
again after it is undone (about 10 s each).

    python tools/mutate.py                     # every mutation, targeted tests
    python tools/mutate.py --only accept-always seed-ignored
    python tools/mutate.py --full --json out.json
    python tools/mutate.py --source HEAD       # the committed tree instead of the working tree
    python tools/mutate.py --source HEAD --overlay tests/test_x.py runtime/decoding/speculative.py
    python tools/mutate.py --list

Exit status: 0 when every mutation is caught, 1 when one survived or is stale, 2 on a bad baseline
(the unmutated copy fails its tests). Run it before resolving an issue that touches decoding or
parsing, and add a mutation for each bug a new test is meant to catch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = {"runtime": "runtime", "calib": "calib", "csrc": "csrc"}  # s2moe/<name> → <folder>


from mutations import MUTATIONS, Mutation  # noqa: E402,F401  (the list; Mutation for callers)


# -- the scratch copy ---------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def make_copy(source: str, dest: str) -> None:
    """``worktree``: tracked and untracked-but-not-ignored files as they are on disk (plus built
    extension modules); anything else: that git revision, plus this checkout's built extension."""
    if source == "worktree":
        files = _git("ls-files", "-co", "--exclude-standard", "-z").split("\0")
        files += [f for f in _git("ls-files", "-oi", "--exclude-standard", "-z").split("\0")
                  if f.endswith((".so", ".pyd"))]
        for rel in filter(None, files):
            src = os.path.join(ROOT, rel)
            if not os.path.isfile(src):
                continue  # deleted in the working tree
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    else:
        archive = subprocess.run(["git", "archive", source], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        os.makedirs(os.path.join(dest, "s2moe"), exist_ok=True)
        for name in os.listdir(os.path.join(ROOT, "s2moe")):  # the extension built here: not in git
            if name.endswith((".so", ".pyd")):
                shutil.copy2(os.path.join(ROOT, "s2moe", name), os.path.join(dest, "s2moe", name))
    os.makedirs(os.path.join(dest, "s2moe"), exist_ok=True)
    for name, folder in SHIM.items():
        link = os.path.join(dest, "s2moe", name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", folder), link)


def run_pytest(copy: str, args: list[str], timeout: float) -> tuple[str, float, str]:
    env = {**os.environ, "PYTHONPATH": copy + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("S2MOE_DEBUG", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", *args]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    took = time.perf_counter() - t0
    out = r.stdout + r.stderr
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in out.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    detail = failed[0] if failed else out.strip().splitlines()[-1] if out.strip() else ""
    if r.returncode == 0:
        return "passed", took, detail
    if r.returncode == 5:
        return "no tests", took, detail
    return "failed", took, detail


@dataclass
class Result:
    id: str
    status: str  # caught | survived | stale | equivalent | no tests
    seconds: float
    caught_by: str = ""
    file: str = ""
    note: str = ""
    tests: list[str] = field(default_factory=list)


def rebuild(copy: str) -> None:
    """Build the copy's CPU kernels from its (mutated or restored) sources, in place."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"], cwd=copy, check=True,
                   capture_output=True)


def check(copy: str, m: Mutation, full: bool, timeout: float) -> Result:
    path = os.path.join(copy, m.file)
    res = Result(m.id, "stale", 0.0, file=m.file, note=m.note, tests=[] if full else m.tests)
    if not os.path.exists(path):
        return res
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.count(m.original) != 1:
        return res
    if m.equivalent_if and m.equivalent_if in text:
        res.status, res.caught_by = "equivalent", m.equivalent_why
        return res
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(m.original, m.replacement))
        if m.file.startswith("csrc/cpu/"):  # a kernel mutant: the copy's extension is rebuilt with it
            rebuild(copy)
        outcome, took, detail = run_pytest(copy, [] if full else m.tests, timeout)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if m.file.startswith("csrc/cpu/"):
            rebuild(copy)
    res.seconds = round(took, 1)
    res.status = {"passed": "survived", "no tests": "no tests"}.get(outcome, "caught")
    res.caught_by = detail if outcome == "failed" else outcome if outcome == "timeout" else ""
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="mutation ids to run (default: all)")
    ap.add_argument("--full", action="store_true", help="run the whole suite for each mutation")
    ap.add_argument("--source", default="worktree", help="'worktree' (default) or a git revision")
    ap.add_argument("--overlay", nargs="*", default=[],
                    help="working-tree files (or folders) copied over the source (e.g. yours, over HEAD)")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()

    chosen = [m for m in MUTATIONS if not args.only or m.id in args.only]
    unknown = set(args.only or []) - {m.id for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation ids: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id:28s} {m.file:45s} {m.note}")
        return 0

    copy = tempfile.mkdtemp(prefix="s2moe-mutate-")
    try:
        make_copy(args.source, copy)
        for rel in args.overlay:
            src, dst = os.path.join(ROOT, rel), os.path.join(copy, rel)
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)
        if not args.no_baseline:
            union: list[str] = []
            if not args.full:
                for m in chosen:  # files and node ids only: -k expressions narrow single mutations
                    union += [t for t in m.tests if t.startswith("tests/") and t not in union]
            outcome, took, detail = run_pytest(copy, union, args.timeout)
            print(f"baseline ({len(union) or 'all'} test paths): {outcome} in {took:.0f} s")
            if outcome != "passed":
                print(f"the unmutated copy does not pass: {detail}", file=sys.stderr)
                return 2
        results = []
        for m in chosen:
            r = check(copy, m, args.full, args.timeout)
            results.append(r)
            print(f"{r.status:9s} {r.seconds:6.1f}s  {r.id:28s} {r.caught_by}", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)

    width = max(len(r.id) for r in results)
    print("\n" + f"{'mutation':{width}s}  {'status':9s} {'secs':>6s}  caught by")
    for r in results:
        print(f"{r.id:{width}s}  {r.status:9s} {r.seconds:6.1f}  {r.caught_by}")
    bad = [r for r in results if r.status not in ("caught", "equivalent")]
    print(f"\n{len(results) - len(bad)} of {len(results)} caught" + (f"; not caught: {', '.join(r.id for r in bad)}"
                                                                    if bad else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.source, "full": args.full, "results": [asdict(r) for r in results]}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
