"""How many experts the draft should take, measured: per draft k, how many of the draft's tokens
the target would keep, and what a draft pass costs, in one greedy decode where every k drafts at
every step; then the speed those figures model for each k.

    python benchmarks/draft_topk.py [--model DIR] [--budget 0.25] [--n-prompts 2] [--tokens 48]
                                    [--cap 8] [--out docs/results/draft-topk/model]

What is measured and modeled, and why, is in `calib/draft_k.py`, which `s2moe-calib profile` uses to
choose k; this prints its figures for a model and budget. `docs/results/draft-topk/` holds A/B runs
of `s2moe bench` at each k to hold the model's ranking against.
Prompts: HumanEval, GSM8K and MT-Bench, ``--n-prompts`` of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from s2moe.calib.draft_k import choose, measure  # noqa: E402
from s2moe.runtime.records import Record, machine_info, write_outputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--n-prompts", type=int, default=2, help="prompts of each workload")
    ap.add_argument("--tokens", type=int, default=48, help="target steps per prompt")
    ap.add_argument("--cap", type=int, default=8, help="longest draft chain the model considers")
    ap.add_argument("--out", default="docs/results/draft-topk/model")
    args = ap.parse_args()

    from s2moe.runtime.bench import resolve_workload
    from s2moe.runtime.cli.common import DEFAULT_MODEL
    from s2moe.runtime.cli.spec_options import default_draft_topk
    from s2moe.calib.profile_cmd import draft_policy
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.tokenizer import load_tokenizer
    from s2moe.runtime.prompts import load_workload

    path = args.model or str(DEFAULT_MODEL)
    engine = build_engine(path, budget=args.budget)
    model = engine.model
    tok = load_tokenizer(engine.loaded)
    ks = list(range(1, model.config.top_k + 1))
    prompts = [tok.encode(p).ids[-256:] for w in ("humaneval", "gsm8k", "mt-bench")
               for p in load_workload(resolve_workload(w))[:args.n_prompts]]
    got = measure(model, prompts, args.tokens, ks, args.cap, lambda k: draft_policy(model, k),  # as runs draft
                  lambda: print("prompt done", file=sys.stderr, flush=True))
    chosen, table = choose(got, args.cap, default_draft_topk(model.config.top_k))
    t_ar = statistics.median(got["t_ar"])
    params = {"model": os.path.basename(path.rstrip("/")), "budget": args.budget, "steps": len(got["t_ar"]),
              "cap": args.cap, "prompts_per_workload": args.n_prompts, "tokens": args.tokens}
    records = [Record("draft-topk", f"draft k={k}: pass", "s", got["c_draft"][k], params={**params, "draft_topk": k},
                      extra={**table["candidates"][str(k)], "kept": got["kept"][k]}) for k in ks]
    records.append(Record("draft-topk", "target step", "s", got["t_ar"], params=params, extra={"chosen": chosen}))
    write_outputs(records, machine_info(), args.out, "draft k: tokens kept, pass cost, modeled speed")
    print(f"| draft k | first token agrees | chain tokens kept (of {args.cap}) | C_draft | C_draft / T_AR | best chain "
          "| modeled tokens per T_AR |")
    print("|---|---|---|---|---|---|---|")
    for k in ks:
        row = table["candidates"][str(k)]
        mark = " (chosen)" if k == chosen else " (default)" if k == table["default"] else ""
        print(f"| {k}{mark} | {row['first_token_agreement']:.3f} | {row['mean_kept']:.2f} | {row['c_draft_ms']:.3f} ms | "
              f"{row['c_draft_ms'] / (t_ar * 1e3):.3f} | {row['best_chain']} | {row['modeled_tokens_per_t_ar']:.2f} |")
    over = ", ".join(f"k = {k}: {v['over_default']['mean']:+.3f} ± {v['over_default']['standard_error']:.3f}"
                     for k, v in table["candidates"].items() if "over_default" in v)
    print(f"\nT_AR {t_ar * 1e3:.3f} ms over {len(got['t_ar'])} steps. Over the default k = {table['default']} "
          f"(modeled tokens per T_AR, paired, ± 1 SE over prompts): {over}; chosen: k = {chosen}.")


if __name__ == "__main__":
    main()
