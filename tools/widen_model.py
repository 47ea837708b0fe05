"""Widen the embedded default model to a released model's shape, keeping its function exactly.

    python tools/widen_model.py --preset olmoe-1b-7b --out DIR          # hidden 2048, 16 layers, 64 × top-8
    python tools/widen_model.py --hidden 1024 --intermediate 512 --out DIR

The embedded model (hidden 256, 4 layers, 32 experts top-4, 8 heads of 32, expert FFN 112) is bound
by interpreter overhead on a CPU, not by expert traffic; the paper's devices are in the other regime.
The widened copy keeps its tokens, routing and acceptance (tests/test_widen.py) with the bytes and
compute of the larger shape. Every construction is exact in real arithmetic:

- **Wider residual stream** (256 → H): embedding, router, q/k/v input columns and o_proj / expert
  down output rows padded with zeros. RMSNorm's mean of squares shrinks by 256/H: its weights are
  scaled by √(256/H) and ``rms_norm_eps`` by 256/H.
- **Wider expert FFN** (→ I): gate/up rows and down columns padded with zeros (silu(0) · 0 = 0).
- **More experts** (E0 → s · E0): each trained expert's neurons are split between s experts; SwiGLU
  sums over neurons, so the parts add back up. Every part takes its expert's router row, top-k
  grows s-fold, and the down projections are scaled by s: softmax over the duplicated logits gives
  each part p / s (and so does renormalising the top-k), so the mixture is unchanged.
- **More and wider heads** (8 × 32 → n × D, no GQA): original head h stays head h; its KV head is
  copied into every new KV head its query heads use; the other heads are zero. RoPE rotates pairs
  (i, i + D/2) at θ^(−2i/D): dimension i of a D0-wide head goes to r · i (r = D / D0), whose
  frequency is the same. OLMoE's q/k norms run over all heads: their weights are scaled like the
  residual norms' (exact when n · D = 8 · 32 · H / 256, as at OLMoE-1B-7B), and q_norm's by √r more,
  which undoes the softmax scale's 1/√D.
- **More layers** (4 → m · 4): before each trained layer, m − 1 identity layers, copies of it whose
  o_proj and expert down projections are zero. Their routers see the residual stream the trained
  layer sees, so they load the experts it would; their compute and bytes are real.

Weights are F16 safetensors (the embedded model's own type; the scaled norm weights F32), one shard
per layer with an index, each written to a temporary name and renamed, with the tokenizer and
generation config. ``--gguf Q8_0,Q4_K_M --quantize PATH/llama-quantize`` also writes GGUFs beside
it: the types `s2moe convert` writes directly, and llama.cpp's mixes through llama-quantize from a
Q8_0 (with ``--override-kv general.alignment=int:32``: llama-quantize keeps the source's 4096-byte
alignment key but aligns its data to 32, and the file it writes is short). At OLMoE-1B-7B's shape
both s2moe and llama.cpp give the embedded model's greedy text on the Q8_0 and the Q4_K_M.
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

# released shapes (head counts: query = KV)
PRESETS = {"olmoe-1b-7b": dict(hidden=2048, intermediate=1024, layers=16, experts=64, heads=16, head_dim=128)}


class Shape:
    """The source's shape, the target's, and the index maps between them."""

    def __init__(self, config: dict, hidden: int, intermediate: int, layers: int | None, experts: int | None,
                 heads: int | None, head_dim: int | None):
        self.H0, self.I0 = config["hidden_size"], config["intermediate_size"]
        self.L0, self.E0 = config["num_hidden_layers"], config["num_experts"]
        self.nq0, self.nkv0 = config["num_attention_heads"], config["num_key_value_heads"]
        self.D0 = config.get("head_dim") or self.H0 // self.nq0
        self.H, self.I = hidden, intermediate
        self.L, self.E = layers or self.L0, experts or self.E0
        self.nq, self.D = heads or self.nq0, head_dim or self.D0
        self.heads_changed = (self.nq, self.D) != (self.nq0, self.D0)
        self.nkv = self.nq if self.heads_changed else self.nkv0
        self.s, self.m, self.r = self.E // self.E0, self.L // self.L0, self.D // self.D0
        problems = [f"--hidden {hidden} < {self.H0}" if hidden < self.H0 else "",
                    f"--experts {self.E} is not a multiple of {self.E0}" if self.E % self.E0 else "",
                    f"--layers {self.L} is not a multiple of {self.L0}" if self.L % self.L0 else "",
                    f"--heads {self.nq} < {self.nq0}" if self.nq < self.nq0 else "",
                    f"--head-dim {self.D} is not a multiple of {self.D0}" if self.D % self.D0 else ""]
        if not self.E % self.E0 and intermediate < math.ceil(self.I0 / self.s):
            problems.append(f"--intermediate {intermediate} < {math.ceil(self.I0 / self.s)} (an expert's share of {self.I0})")
        problems = [p for p in problems if p]
        if problems:
            raise SystemExit("error: " + "; ".join(problems))
        # a head's dimension d → its place in the wider head (the RoPE pair keeps its frequency)
        half0 = self.D0 // 2
        self.dim = np.array([self.r * d if d < half0 else self.D // 2 + self.r * (d - half0) for d in range(self.D0)])

    def head_rows(self, kv: bool) -> tuple[np.ndarray, np.ndarray]:
        """(new, old) row indices of q (kv=False) or k/v projections: new head h ← old head h, or
        for k/v the old KV head of query head h."""
        new, old = [], []
        for h in range(self.nq0):
            src = h // (self.nq0 // self.nkv0) if kv else h
            new.append(h * self.D + self.dim)
            old.append(src * self.D0 + np.arange(self.D0))
        return np.concatenate(new), np.concatenate(old)


def widen(src: str, out: str, hidden: int, intermediate: int, layers: int | None = None, experts: int | None = None,
          heads: int | None = None, head_dim: int | None = None) -> str:
    from safetensors.numpy import load_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != "olmoe":
        raise SystemExit(f"error: {src}: widening is written for OLMoE (found {config.get('model_type')})")
    sh = Shape(config, hidden, intermediate, layers, experts, heads, head_dim)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    os.makedirs(out, exist_ok=True)
    shards = 1 + sh.L
    weight_map: dict[str, str] = {}

    def write(i: int, part: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tmp = os.path.join(out, f".{name}.tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in part.items()}, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(out, name))
        weight_map.update({k: name for k in part})

    scale = math.sqrt(sh.H0 / sh.H)
    write(0, {"model.embed_tokens.weight": _pad(tensors["model.embed_tokens.weight"], (None, sh.H)),
              "lm_head.weight": _pad(tensors["lm_head.weight"], (None, sh.H)),
              "model.norm.weight": _pad(tensors["model.norm.weight"], (sh.H,)).astype(np.float32) * scale})
    for layer in range(sh.L):
        trained, identity = layer // sh.m, layer % sh.m != sh.m - 1
        write(1 + layer, _layer(tensors, sh, trained, layer, identity, scale))
    index = {"metadata": {}, "weight_map": weight_map}
    _write_json(os.path.join(out, "model.safetensors.index.json"), index)
    H0, I0, L0, E0 = sh.H0, sh.I0, sh.L0, sh.E0
    config.update(hidden_size=sh.H, intermediate_size=sh.I, num_hidden_layers=sh.L, num_experts=sh.E,
                  num_experts_per_tok=config["num_experts_per_tok"] * sh.s, num_attention_heads=sh.nq,
                  num_key_value_heads=sh.nkv, head_dim=sh.D, rms_norm_eps=config["rms_norm_eps"] * H0 / sh.H)
    config["s2moe_widened_from"] = {
        "hidden_size": H0, "intermediate_size": I0, "num_hidden_layers": L0, "num_experts": E0,
        "num_attention_heads": sh.nq0, "num_key_value_heads": sh.nkv0, "head_dim": sh.D0,
        "trained_layers": [i * sh.m + sh.m - 1 for i in range(L0)], "experts_per_trained_expert": sh.s,
        "note": "function-preserving copy of the embedded model (tools/widen_model.py)"}
    _write_json(os.path.join(out, "config.json"), config)
    for extra in ("tokenizer.json", "generation_config.json", "token_ranks.json"):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(out, extra))
    if os.path.exists(os.path.join(out, "model.safetensors")):  # an earlier single-file widening here
        os.remove(os.path.join(out, "model.safetensors"))
    return out


def _layer(t: dict[str, np.ndarray], sh: Shape, i: int, layer: int, identity: bool, scale: float) -> dict:
    """Layer `layer` of the widened model from trained layer i (an identity copy when `identity`)."""
    src, dst = f"model.layers.{i}.", f"model.layers.{layer}."
    out: dict[str, np.ndarray] = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[dst + norm + ".weight"] = _pad(t[src + norm + ".weight"], (sh.H,)).astype(np.float32) * scale
    a = src + "self_attn."
    if not sh.heads_changed:  # attention width unchanged: only the residual stream's columns
        q, k, v = (_pad(t[a + p + "_proj.weight"], (None, sh.H)) for p in "qkv")
        o = _pad(t[a + "o_proj.weight"], (sh.H, None))
        qn, kn = t[a + "q_norm.weight"], t[a + "k_norm.weight"]
    else:
        qn_rows, qo_rows = sh.head_rows(kv=False)
        kn_rows, ko_rows = sh.head_rows(kv=True)
        q = _place(t[a + "q_proj.weight"], (sh.nq * sh.D, sh.H), qn_rows, qo_rows)
        k = _place(t[a + "k_proj.weight"], (sh.nkv * sh.D, sh.H), kn_rows, ko_rows)
        v = _place(t[a + "v_proj.weight"], (sh.nkv * sh.D, sh.H), kn_rows, ko_rows)
        o = _place(t[a + "o_proj.weight"].T, (sh.nq * sh.D, sh.H), qn_rows, qo_rows).T
        rho_q = sh.nq0 * sh.D0 / (sh.nq * sh.D)  # the norms' mean of squares shrinks by this
        rho_k = sh.nq0 * sh.D0 / (sh.nkv * sh.D)  # (each KV head copied to its query heads)
        qn = _place(t[a + "q_norm.weight"], (sh.nq * sh.D,), qn_rows, qo_rows).astype(np.float32)
        kn = _place(t[a + "k_norm.weight"], (sh.nkv * sh.D,), kn_rows, ko_rows).astype(np.float32)
        qn *= math.sqrt(rho_q * sh.H / sh.H0) * scale * math.sqrt(sh.r)  # and the softmax's 1/√D back to 1/√D0
        kn *= math.sqrt(rho_k * sh.H / sh.H0) * scale
    if identity:
        o = np.zeros_like(o)
    out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": o,
                dst + "self_attn.q_norm.weight": qn, dst + "self_attn.k_norm.weight": kn})
    router = t[src + "mlp.gate.weight"]
    out[dst + "mlp.gate.weight"] = _pad(np.repeat(router, sh.s, axis=0), (None, sh.H))  # part j of e: row e·s + j
    for e in range(sh.E0):
        x = f"{src}mlp.experts.{e}."
        for j, neurons in enumerate(np.array_split(np.arange(sh.I0), sh.s)):
            y = f"{dst}mlp.experts.{e * sh.s + j}."
            out[y + "gate_proj.weight"] = _pad(t[x + "gate_proj.weight"][neurons], (sh.I, sh.H))
            out[y + "up_proj.weight"] = _pad(t[x + "up_proj.weight"][neurons], (sh.I, sh.H))
            down = t[x + "down_proj.weight"][:, neurons] * np.float16(sh.s)  # exact: s a power of two, no overflow
            out[y + "down_proj.weight"] = np.zeros((sh.H, sh.I), down.dtype) if identity else _pad(down, (sh.H, sh.I))
    return out


def export(folder: str, types: list[str], quantize: str | None) -> list[str]:
    """GGUFs of the widened folder, `folder`-<type>.gguf: direct types by s2moe's writer, llama.cpp's
    mixes (Q4_K_M, …) by llama-quantize from a Q8_0 written first."""
    import subprocess

    from s2moe.runtime.model.formats.gguf_writer import write_gguf
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.offload.store import ExpertStore

    loaded, written = load_model(folder, dense=False), []
    base = os.path.normpath(folder)
    for kind in types:
        path = f"{base}-{kind.lower()}.gguf"
        direct = kind in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
        if not direct and not (quantize and os.path.exists(quantize)):
            raise SystemExit(f"error: --gguf {kind} is a llama.cpp mix: give --quantize PATH/llama-quantize")
        source = path if direct else path + ".q8_0.tmp"
        write_gguf(loaded, source + ".part", ExpertStore(loaded).read, kind if direct else "Q8_0", None, False,
                   loaded.tokenizer_path)
        os.replace(source + ".part", source)
        if not direct:
            try:
                r = subprocess.run([quantize, "--allow-requantize", "--override-kv", "general.alignment=int:32", source,
                                    path + ".part", kind, str(os.cpu_count() or 2)], capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"error: llama-quantize failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
                os.replace(path + ".part", path)
            finally:
                os.unlink(source)
        written.append(path)
    return written


def _pad(w: np.ndarray, shape: tuple) -> np.ndarray:
    shape = tuple(n if n is not None else w.shape[i] for i, n in enumerate(shape))
    out = np.zeros(shape, dtype=w.dtype)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def _place(w: np.ndarray, shape: tuple, new_rows: np.ndarray, old_rows: np.ndarray) -> np.ndarray:
    """Rows old_rows of w at new_rows of a zero array of `shape` (columns padded)."""
    out = np.zeros(shape, dtype=w.dtype)
    if w.ndim == 1:
        out[new_rows] = w[old_rows]
    else:
        out[new_rows, : w.shape[1]] = w[old_rows]
    return out


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main() -> None:
    from s2moe.runtime.cli.common import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a released model's shape")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--heads", type=int, help="query heads (= KV heads when heads or head dim change)")
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--src", default=str(DEFAULT_MODEL), help="an OLMoE HF folder (default: the embedded model)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default="", help="also write GGUFs of these types, e.g. Q8_0,Q4_K_M (OUT-<type>.gguf)")
    ap.add_argument("--quantize", help="llama-quantize, for llama.cpp's mixes (benchmarks/peer.py --build makes it)")
    args = ap.parse_args()
    shape = dict(PRESETS.get(args.preset, {}))
    for key in ("hidden", "intermediate", "layers", "experts", "heads", "head_dim"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape.setdefault("hidden", 1024)
    shape.setdefault("intermediate", 512)
    print(f"wrote {widen(args.src, args.out, **shape)}", file=sys.stderr)
    for path in export(args.out, [t.strip().upper() for t in args.gguf.split(",") if t.strip()], args.quantize):
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
