"""Backs docs/performance/peer.md, "At OLMoE-1B-7B's size, every common type" and the page's other
llama.cpp sections (GPT-OSS-20B, DeepSeek-V2-Lite, prefill, first token, the capped OLMoE-1B-7B and
Qwen3-30B-A3B runs, "llama.cpp as the peer"): s2moe vs llama.cpp on the same GGUF file, uncapped and
under a memory cgroup.

llama.cpp as the outside reference: AR decode speed of llama.cpp and s2moe on the same GGUF.

    python benchmarks/peer.py --build                 # once: llama.cpp from the llama-cpp-python sdist
    python benchmarks/peer.py [--reps 5] [--tokens 64] [--types F16,Q8_0]
    python benchmarks/peer.py --preset olmoe-1b-7b --types Q4_K_M,Q6_K,Q4_0 --settings uncapped
    python benchmarks/peer.py --preset olmoe-1b-7b --types Q4_K_M --settings prefill

llama.cpp is built from the llama.cpp vendored in the `llama-cpp-python` sdist on PyPI (cmake,
about 8 minutes on 2 cores), cached outside the repository (--cache, default ~/.cache/s2moe-peer).
The model is a random OLMoE-style model at a realistic width (hidden 1024, 32 experts top-4,
intermediate 512, 4 layers, 16 heads: llama.cpp's OLMoE loader wants k_norm as wide as q), written
as safetensors and converted by `s2moe convert` to each GGUF type; both programs read that file.
With --preset, the model has a released model's shape (real_models.py: random blocks written
directly, the K-quant mixes by llama-quantize), and llama.cpp runs as shipped (weights repacked)
and with --repack 0; both are recorded, and the comparison takes the faster.

Two settings, each in one run with alternating repetitions (programs take turns, so drift hits
both alike), 2 threads each:
- uncapped: llama.cpp (mmap, its default) and s2moe with every expert resident;
- capped: each program alone in a memory cgroup of its own non-model baseline + the dense part's
  stored bytes + 25 % of the experts' stored bytes, the file's page cache dropped before every run.
  llama.cpp runs with mmap (the page cache is its expert cache) and with --load-mode none (which
  must load the whole model); s2moe with --budget = the cap less its baseline (its plan fits dense
  part, KV, workspace and as many experts as remain: a little under 25 %).
- prefill: prompt processing in tokens/s at 64 and 512 prompt tokens (llama-bench pp64 / pp512;
  s2moe run on a prompt of that many tokens, its prefill time), every expert resident.
A program's non-model baseline is measured uncapped: its peak (cgroup) minus the model bytes it held
(llama.cpp's from its mmap run: with --no-mmap its buffered read also charges the file's pages).

--file PATH takes a GGUF with trained weights (tools/widen_model.py's real-size model): both programs
decode PROMPT greedily, llama.cpp by llama-completion (its eval-time tokens/s, and its text), s2moe
as AR and as S²-MoE; each record keeps the text, and the table says whether it is llama.cpp's.
--share takes a list (0.25,0.10): one capped setting per share.

Results: a table on stderr, JSON and CSV in docs/results/peer.* (--out); docs/performance/peer.md quotes them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from benchmarks.common import Record, machine_info, rounds, write_outputs  # noqa: E402
from benchmarks.synthetic import write_olmoe  # noqa: E402

CACHE = os.path.expanduser("~/.cache/s2moe-peer")
PROMPT = "def fibonacci(n):"


def build(cache: str) -> str:
    """Download the llama-cpp-python sdist; build llama-bench, -completion and -quantize from its
    vendored llama.cpp."""
    os.makedirs(cache, exist_ok=True)
    sdists = glob.glob(os.path.join(cache, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", cache], check=True)
        sdists = glob.glob(os.path.join(cache, "llama_cpp_python-*.tar.gz"))
    sdist = sorted(sdists)[-1]
    src = sdist[: -len(".tar.gz")]
    if not os.path.isdir(src):
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    llama = os.path.join(src, "vendor", "llama.cpp")
    out = os.path.join(cache, "build")
    subprocess.run(["cmake", "-S", llama, "-B", out, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"], check=True)
    subprocess.run(["cmake", "--build", out, "-j", str(os.cpu_count() or 2), "--target", "llama-bench",
                    "llama-completion", "llama-quantize"], check=True)
    return bench_binary(cache)


def bench_binary(cache: str) -> str:
    path = os.path.join(cache, "build", "bin", "llama-bench")
    if not os.path.exists(path):
        sys.exit(f"error: {path} not found; run: python benchmarks/peer.py --build")
    return path


def models(cache: str, types: list[str]) -> dict[str, str]:
    folder = os.path.join(cache, "olmoe-h1024-e32k4-i512-l4")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        write_olmoe(folder, hidden=1024, layers=4, experts=32, top_k=4, intermediate=512, vocab=6144, heads=16,
                    kv_heads=16)
        from s2moe.runtime.cli.common import DEFAULT_MODEL

        shutil.copy(os.path.join(str(DEFAULT_MODEL), "tokenizer.json"), folder)  # llama.cpp sizes the vocabulary by it
    out = {}
    for kind in types:
        path = os.path.join(cache, f"olmoe-h1024-{kind.lower()}.gguf")
        if not os.path.exists(path):
            subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "convert", "--model", folder, "--out", path,
                            "--type", kind], check=True)
        out[kind] = path
    return out


def sizes(path: str) -> dict:
    from s2moe.runtime.model.loader import load_model

    loaded = load_model(path, dense=False)
    return {"dense_stored": loaded.dense_stored_bytes, "expert_stored": loaded.expert_stored_bytes,
            "file": os.path.getsize(path)}


def real_models(cache: str, preset: str, types: list[str]) -> dict[str, str]:
    from benchmarks.real_models import make

    out = {}
    for kind in types:
        path = os.path.join(cache, f"{preset}-{kind.lower()}.gguf")
        if not os.path.exists(path):
            print(f"writing {path}", file=sys.stderr)
            make(preset, kind, path, os.path.join(cache, "build", "bin", "llama-quantize"))
        out[kind] = path
    return out


def llama_cmd(binary: str, path: str, tokens: int, threads: int, mmap: bool, repack: bool = True) -> list[str]:
    return [binary, "-m", path, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1", "-o", "json",
            "--load-mode", "mmap" if mmap else "none", "--repack", "1" if repack else "0"]


def first_token_cmds(cache: str, path: str, threads: int) -> dict[str, list[str]]:
    """One token from a prompt, from a cold start: llama.cpp's llama-completion (as shipped, and with
    --no-repack) and s2moe run: as shipped, the prompt reads the experts it needs and the rest come
    after the first token (--load background), and with --load now (every expert before the prompt)."""
    completion = os.path.join(cache, "build", "bin", "llama-completion")
    llama = [completion, "-m", path, "-p", PROMPT, "-n", "1", "-t", str(threads), "--temp", "0", "-no-cnv",
             "--simple-io", "--no-warmup"]
    return {"llama.cpp mmap": llama, "llama.cpp mmap repack 0": llama + ["--no-repack"],
            "s2moe": s2moe_cmd(path, 1, threads, None, load="background"),
            "s2moe --load now": s2moe_cmd(path, 1, threads, None)}


def first_token_seconds(cmd: list[str], path: str) -> tuple[float | None, str]:
    """Wall seconds from launch to exit of a one-token run, the file's pages dropped first."""
    import time

    common.drop_page_cache(path)
    start = time.perf_counter()
    r = common.run_in_cgroup(cmd, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"})
    seconds = time.perf_counter() - start
    return (seconds, "ok") if r.returncode == 0 else (None, f"exit {r.returncode}")


def s2moe_cmd(path: str, tokens: int, threads: int, budget: int | None, sampled: bool = False,
              load: str = "now", method: str = "ar") -> list[str]:
    """``sampled``: T = 1 with a fixed seed. Random weights make greedy text repeat one token, so its
    routing never moves and a capped run would find its experts cached (llama-bench's tg feeds
    random tokens). ``load`` now: decode and prefill are timed warm, as llama-bench's are after
    its warm-up run."""
    cmd = [sys.executable, "-m", "s2moe.runtime.cli", "run", "--model", path, "--prompt", PROMPT, "-n", str(tokens),
           "--method", method, "--threads", str(threads), "--json", "--ignore-eos", "--load", load]
    cmd += ["--temperature", "1", "--top-k", "0", "--top-p", "1", "--seed", "0"] if sampled else ["--temperature", "0"]
    return cmd + (["--budget", str(budget)] if budget else [])


def text_cmds(cache: str, path: str, tokens: int, threads: int) -> dict[str, list[str]]:
    """--file: greedy decoding of PROMPT by both programs, with their texts (llama.cpp's best of
    repacked or stored weights, mapped or read)."""
    completion = os.path.join(cache, "build", "bin", "llama-completion")
    llama = [completion, "-m", path, "-p", PROMPT, "-n", str(tokens), "-t", str(threads), "--temp", "0", "-no-cnv",
             "--simple-io", "--no-warmup", "--no-display-prompt", "--ignore-eos"]
    return {"llama.cpp mmap": llama, "llama.cpp mmap repack 0": llama + ["--no-repack"],
            "llama.cpp no-mmap": llama + ["--load-mode", "none"], "s2moe": s2moe_cmd(path, tokens, threads, None),
            "s2moe s2moe": s2moe_cmd(path, tokens, threads, None, method="s2moe")}


EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def completion_result(stdout: str, stderr: str) -> tuple[float | None, str]:
    """llama-completion's decode tokens/s (its "eval time" line: the prompt is "prompt eval") and text."""
    for line in stderr.splitlines():
        if "prompt eval time" not in line and (m := EVAL.search(line)):
            ms, runs = float(m.group(1)), int(m.group(2))
            return (runs / (ms / 1e3) if ms > 0 else None), stdout.replace("[end of text]", "").strip()
    return None, stdout.strip()


PREFILL_SIZES = (64, 512)


def prefill_prompt(cache: str, tokens: int) -> str:
    """A file of Python source that the benchmark models' tokenizer (the embedded model's, which
    real_models.py writes into every file) encodes to ``tokens`` tokens, or one or two more (the
    record keeps the count run reports)."""
    from tokenizers import Tokenizer

    from s2moe.runtime.cli.common import DEFAULT_MODEL

    tok = Tokenizer.from_file(os.path.join(str(DEFAULT_MODEL), "tokenizer.json"))
    source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py"), encoding="utf-8").read()
    ids = tok.encode(source * (1 + 8 * tokens // len(source))).ids[:tokens]
    text = tok.decode(ids)  # (byte-level BPE: the text encodes back to these tokens, or about)
    path = os.path.join(cache, f"prompt-{tokens}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def prefill_cmds(binary: str, path: str, cache: str, tokens: int, threads: int) -> dict[str, list[str]]:
    bench = [binary, "-m", path, "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "1", "-o", "json"]
    s2moe = [sys.executable, "-m", "s2moe.runtime.cli", "run", "--model", path, "--prompt-file",
             prefill_prompt(cache, tokens), "-n", "1", "--method", "ar", "--temperature", "0", "--threads",
             str(threads), "--json", "--ignore-eos", "--load", "now"]
    return {"llama.cpp mmap": bench + ["--repack", "1"], "llama.cpp mmap repack 0": bench + ["--repack", "0"],
            "s2moe": s2moe}


def run(cmd: list[str], limit: int | None, drop: str | None, texts: list | None = None) -> tuple[float | None, int | None, str]:
    """(tokens/s or None, cgroup peak bytes, outcome): decode's, or prefill's for a run of one
    token (s2moe) or a pp test (llama-bench). ``texts``: the decoded text is appended to it."""
    if drop:
        common.drop_page_cache(drop)
    r = common.run_in_cgroup(cmd, limit_bytes=limit, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if r.oom_killed:
        return None, r.peak_bytes, "OOM-killed"
    if r.returncode != 0:
        return None, r.peak_bytes, f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1][:200] if r.stderr else ''}"
    if os.path.basename(cmd[0]) == "llama-completion":
        tps, text = completion_result(r.stdout, r.stderr)
        if texts is not None:
            texts.append(text)
        return tps, r.peak_bytes, "ok" if tps else "no eval-time line"
    data = json.loads(r.stdout)
    if texts is not None and isinstance(data, dict):
        texts.append(data.get("text", "").strip())
    if isinstance(data, list):  # llama-bench: one record per test
        return float(data[0]["avg_ts"]), r.peak_bytes, "ok"
    stats = data["stats"]
    if stats["generated_tokens"] == 1:  # a prefill run
        return stats["prompt_tokens"] / (stats["prefill_ms"] / 1e3), r.peak_bytes, f"ok ({stats['prompt_tokens']} tokens)"
    return float(stats["decode_tokens_per_s"]), r.peak_bytes, "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true",
                    help="build llama.cpp's tools (cached) and stop: a run writes --out, which docs cite")
    ap.add_argument("--cache", default=CACHE)
    ap.add_argument("--types", default="F16,Q8_0")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--share", default="0.25", help="expert share(s) in the cap formula, e.g. 0.25,0.10")
    ap.add_argument("--settings", default="uncapped,capped",
                    help="uncapped, capped, prefill, first-token (cold start, 1 token)")
    ap.add_argument("--preset", help="a released model's shape (benchmarks/real_models.py), random weights")
    ap.add_argument("--file", help="a GGUF with trained weights: greedy text from both programs (see above)")
    ap.add_argument("--out", default="docs/results/peer")
    args = ap.parse_args()
    if args.build:
        print(build(args.cache))
        return
    if common.available() is None:
        sys.exit("error: memory cgroups are not writable here; the capped setting needs them")
    binary = bench_binary(args.cache)
    types = [t.strip().upper() for t in args.types.split(",")]
    if args.file:
        paths = {os.path.basename(args.file): args.file}
    else:
        paths = real_models(args.cache, args.preset, types) if args.preset else models(args.cache, types)
    records = []
    for kind, path in paths.items():
        size = sizes(path)
        programs = {
            "llama.cpp mmap": llama_cmd(binary, path, args.tokens, args.threads, True),
            "llama.cpp no-mmap": llama_cmd(binary, path, args.tokens, args.threads, False),
            "s2moe": s2moe_cmd(path, args.tokens, args.threads, None),
        }
        if args.preset:  # its best setting: weights repacked for its SIMD (the default) or as stored
            programs["llama.cpp mmap repack 0"] = llama_cmd(binary, path, args.tokens, args.threads, True, False)
        if args.file:
            programs = text_cmds(args.cache, path, args.tokens, args.threads)
        # each program's non-model baseline: uncapped peak minus the model bytes it held (all of them)
        baseline = {}
        speeds = [x for x in args.settings.split(",") if x in ("uncapped", "capped")]
        for name, cmd in programs.items() if speeds else ():
            if name == "llama.cpp no-mmap":  # its buffered read also fills the page cache: the
                continue  # non-model part is the mmap run's (same program, same buffers)
            _, peak, outcome = run(cmd, None, path)
            held = size["file"] if not name.startswith("s2moe") else size["dense_stored"] + size["expert_stored"]
            baseline[name] = max(peak - held, 0) if peak else 0
            print(f"{kind} {name}: uncapped peak {peak >> 20} MiB, baseline {baseline[name] >> 20} MiB ({outcome})",
                  file=sys.stderr)
        baseline["llama.cpp no-mmap"] = baseline.get("llama.cpp mmap", 0)
        baseline["llama.cpp mmap repack 0"] = baseline.get("llama.cpp mmap repack 0", baseline["llama.cpp no-mmap"])
        shares = [float(x) for x in args.share.split(",")]
        if "first-token" in args.settings.split(","):  # alternating, every program from a cold page cache
            cmds = first_token_cmds(args.cache, path, args.threads)
            seconds = {n: [] for n in cmds}
            outcomes = {n: [] for n in cmds}
            for _, name in rounds(cmds, args.reps):
                sec, outcome = first_token_seconds(cmds[name], path)
                outcomes[name].append(outcome)
                if sec is not None:
                    seconds[name].append(sec)
            for name in cmds:
                records.append(Record("peer", f"{kind} first-token {name}", "s", seconds[name],
                                      params={"type": kind, "setting": "first-token", "program": name,
                                              "threads": args.threads, "model": os.path.basename(path), **size},
                                      extra={"outcomes": outcomes[name]}))
        if "prefill" in args.settings.split(","):  # alternating, every expert resident
            for n in PREFILL_SIZES:
                cmds = prefill_cmds(binary, path, args.cache, n, args.threads)
                samples = {name: [] for name in cmds}
                outcomes = {name: [] for name in cmds}
                for _, name in rounds(cmds, args.reps):
                    tps, _, outcome = run(cmds[name], None, None)
                    outcomes[name].append(outcome)
                    if tps is not None:
                        samples[name].append(tps)
                for name in cmds:
                    records.append(Record("peer", f"{kind} pp{n} {name}", "tok/s", samples[name],
                                          params={"type": kind, "setting": f"pp{n}", "program": name,
                                                  "threads": args.threads, "model": os.path.basename(path), **size},
                                          extra={"outcomes": outcomes[name]}))
        settings = [(s, None) for s in speeds if s == "uncapped"] + [("capped", x) for x in shares if "capped" in speeds]
        for setting, share in settings:
            capped = share is not None
            label = f"capped {share:.0%}" if capped and (len(shares) > 1 or args.file) else setting
            cmds = dict(programs)
            limits = {n: baseline[n] + size["dense_stored"] + int((share or 0) * size["expert_stored"]) for n in cmds}
            for name in [n for n in cmds if n.startswith("s2moe")] if capped else ():
                # told the memory it has (the cap less its baseline), s2moe plans within it
                cmds[name] = cmds[name] + ["--budget", str(limits[name] - baseline[name])]
                if not args.file and args.preset:
                    cmds[name] = s2moe_cmd(path, args.tokens, args.threads, limits[name] - baseline[name], sampled=True)
            if not capped:
                cmds.pop("llama.cpp no-mmap")  # uncapped: llama.cpp's default (mmap) is the reference
            samples = {n: [] for n in cmds}
            peaks = {n: [] for n in cmds}
            outcomes = {n: [] for n in cmds}
            texts = {n: [] for n in cmds}
            for _, name in rounds(cmds, args.reps):  # alternating: every program once per round
                tps, peak, outcome = run(cmds[name], limits[name] if capped else None, path if capped else None,
                                         texts[name])
                outcomes[name].append(outcome)
                peaks[name].append(peak)
                if tps is not None:
                    samples[name].append(tps)
            reference = next((t[0] for n, t in texts.items() if n.startswith("llama.cpp") and t), None)
            for name in cmds:
                text = {"texts": texts[name][:1], "same_text_as_llama_cpp":
                        None if reference is None or not texts[name] else texts[name][0] == reference} if args.file else {}
                records.append(Record("peer", f"{kind} {label} {name}", "tok/s", samples[name],
                                      params={"type": kind, "setting": label, "program": name,
                                              "tokens": args.tokens, "threads": args.threads,
                                              "limit_bytes": limits[name] if capped else None,
                                              "model": os.path.basename(path), **size},
                                      extra={"outcomes": outcomes[name], "peak_bytes": peaks[name],
                                             "baseline_bytes": baseline[name], **text}))
    write_outputs(records, {**machine_info(), "llama_bench": binary}, args.out, "llama.cpp vs s2moe, AR decode")


if __name__ == "__main__":
    main()
