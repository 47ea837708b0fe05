"""What int8 activations cost in quality: the embedded model exported as Q8_0 and Q4_0 GGUF, each
decoded teacher-forced over held-out windows with int8 activations (the default) and with float
ones (S2MOE_FLOAT_ACTIVATIONS=1), same weights, same compiled kernels otherwise.

    python benchmarks/int8_quality.py [--windows 24] [--window 128] [--out docs/results/int8-quality]

Reports the perplexity of each, their ratio, and how often the two agree on the top token. The
held-out split and its windows are tools/evaluate_model.py's (evenly spread over the split).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--out", default="docs/results/int8-quality")
    args = ap.parse_args()
    from evaluate_model import log_softmax, stream

    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.kernels import cpu
    from s2moe.runtime.model.formats.gguf_writer import write_gguf
    from s2moe.runtime.model.forward import MoEModel
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.offload.store import ExpertStore

    source = load_model(str(DEFAULT_MODEL))
    tok = load_tokenizer(source)
    held = stream(tok, "heldout", source.config.eos_token_ids[0])
    starts = np.linspace(0, len(held) - args.window - 2, args.windows).astype(int)
    records, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("Q8_0", "Q4_0"):
            path = os.path.join(tmp, f"default-{dtype}.gguf")
            write_gguf(source, path, ExpertStore(source, direct=False).read, dtype)
            loaded = load_model(path)
            out = {}
            for mode in ("float", "int8"):
                if mode == "float":
                    os.environ["S2MOE_FLOAT_ACTIVATIONS"] = "1"
                else:
                    os.environ.pop("S2MOE_FLOAT_ACTIVATIONS", None)
                model = MoEModel(loaded, ops=cpu.CpuOps())
                assert model.ops.int8_activations == (mode == "int8")
                nll, n, tops = 0.0, 0, []
                for s in starts:
                    ids = held[s:s + args.window + 1]
                    x, y = ids[:-1], ids[1:]
                    logits, _ = model.forward(x, model.new_cache(2 * len(x)))
                    lp = log_softmax(logits.astype(np.float64))
                    nll -= lp[np.arange(len(x)), y].sum()
                    n += len(x)
                    tops.append(logits.argmax(-1))
                out[mode] = (float(np.exp(nll / n)), np.concatenate(tops), n)
            os.environ.pop("S2MOE_FLOAT_ACTIVATIONS", None)
            (pf, tf, n), (pi, ti, _) = out["float"], out["int8"]
            agree = float(np.mean(tf == ti))
            records.append(Record("int8-quality", f"{dtype} export", "ppl", [pf, pi],
                                  params={"dtype": dtype, "windows": args.windows, "window": args.window, "positions": n},
                                  extra={"ppl_float": pf, "ppl_int8": pi, "ppl_ratio": pi / pf, "top1_agreement": agree}))
            rows.append((dtype, pf, pi, pi / pf, agree, n))
    write_outputs(records, machine_info(), args.out, "int8 activations: quality against float activations")
    print("| export | PPL, float activations | PPL, int8 activations | ratio | top-1 agreement | positions |")
    print("|---|---|---|---|---|---|")
    for dtype, pf, pi, r, a, n in rows:
        print(f"| {dtype} | {pf:.4f} | {pi:.4f} | {r:.5f} | {a:.2%} | {n} |")


if __name__ == "__main__":
    main()
