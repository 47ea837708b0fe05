"""Widen the embedded default model by zero-padding: same function, realistic bytes and FLOPs.

    python tools/widen_model.py --hidden 1024 --intermediate 512 --out DIR

The embedded model (hidden 256, expert intermediate 112, 168 KiB experts) is bound by interpreter
overhead on a CPU, not by expert traffic; the paper's devices are in the other regime. The widened
copy keeps its tokens, routing and acceptance, and has the bytes of a hidden-1024 MoE (3 MiB per F16
expert at intermediate 512):
- residual stream 256 → H: embedding, router, q/k/v input columns and o_proj / expert down output
  rows padded with zeros; attention width (heads × head_dim) unchanged;
- expert intermediate 112 → I: gate/up rows and down columns padded with zeros (silu(0) · 0 = 0);
- RMSNorm over the residual stream: the padded entries are zero, so the mean of squares shrinks by
  256/H; the norm weights are scaled by √(256/H) and ``rms_norm_eps`` by 256/H, which makes those
  norms exact. OLMoE's q/k norms (unchanged width) share the eps: theirs moves from 1e-5 to
  1e-5 · 256/H, a relative change below 1e-6 of their output (their inputs' mean squares are ≫ eps).
Weights are written as F16 safetensors (the embedded model's own type; the scaled norm weights as
F32) with its tokenizer and generation config. tests/test_widen.py checks that greedy output and router choices are identical.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def widen(src: str, out: str, hidden: int, intermediate: int) -> str:
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != "olmoe":
        raise SystemExit(f"error: {src}: widening is written for OLMoE (found {config.get('model_type')})")
    H0, I0 = config["hidden_size"], config["intermediate_size"]
    if hidden < H0 or intermediate < I0:
        raise SystemExit(f"error: --hidden {hidden} / --intermediate {intermediate} must be at least {H0} / {I0}")
    scale = math.sqrt(H0 / hidden)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out_t = {}
    for name, w in tensors.items():
        leaf = name.rsplit(".", 2)
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight") or name.endswith("mlp.gate.weight"):
            w = _pad(w, (w.shape[0], hidden))  # [*, H]: new input columns
        elif name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) or name == "model.norm.weight":
            w = _pad(w, (hidden,)).astype(np.float32) * scale  # float32: √(256/H) is exact in F16 only for H = 1024
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            w = _pad(w, (w.shape[0], hidden))
        elif name.endswith("o_proj.weight"):
            w = _pad(w, (hidden, w.shape[1]))
        elif leaf[-2] in ("gate_proj", "up_proj"):
            w = _pad(w, (intermediate, hidden))
        elif leaf[-2] == "down_proj":
            w = _pad(w, (hidden, intermediate))
        out_t[name] = np.ascontiguousarray(w)
    os.makedirs(out, exist_ok=True)
    save_file(out_t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    config.update(hidden_size=hidden, intermediate_size=intermediate, rms_norm_eps=config["rms_norm_eps"] * H0 / hidden)
    config["s2moe_widened_from"] = {"hidden_size": H0, "intermediate_size": I0,
                                    "note": "zero-padded copy of the embedded model (tools/widen_model.py)"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ("tokenizer.json", "generation_config.json", "token_ranks.json"):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(out, extra))
    return out


def _pad(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=w.dtype)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def main() -> None:
    from s2moe.runtime.cli.common import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--src", default=str(DEFAULT_MODEL), help="an OLMoE HF folder (default: the embedded model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(f"wrote {widen(args.src, args.out, args.hidden, args.intermediate)}", file=sys.stderr)


if __name__ == "__main__":
    main()
