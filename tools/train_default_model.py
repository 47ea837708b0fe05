"""Train the embedded default model of s2moe (runtime/assets/default-moe/).

The runtime needs a small but *real* Mixture-of-Experts checkpoint that any
machine can rebuild offline, so this script trains one from scratch on text
every Python install ships (see tools/corpus.py: stdlib sources plus the
English pydoc help topics; ~3% of files held out by a hash of their path).

Choices and reasons:
* Architecture: transformers' OLMoE (OlmoeForCausalLM), the same layout the
  runtime loads for real OLMoE checkpoints.  hidden 256, 4 layers, 8 heads of
  32 with 4 KV heads (GQA), 32 fine-grained experts of width 112, top-4
  routing, norm_topk_prob=False (OLMoE default), untied embeddings.  That is
  ~15M parameters, ~30 MB in fp16 (limit 32 MB).
* Router: aux load-balancing coefficient 0.003 (OLMoE uses 0.01).  Real
  MoEs route unevenly and the runtime's expert cache and self-speculation
  (drafting with top-2 of the same model) depend on that skew, so we do not
  force balance; we measure it (top-25% expert share, top-2/top-1 agreement)
  and write the numbers into training_record.json.  In 200-step pilots, 0.001
  left one layer with only 11 of 32 experts above 1% of the traffic (top-25%
  share 0.90) while 0.01 gave 0.57-0.71; 0.003 sits between the two.
* Tokenizer: byte-level BPE, 6144 entries, `<|endoftext|>` = id 0 is the
  document separator and EOS (no BOS), `<|pad|>` = id 1.  Trained on the
  training split only.
* Optimisation: AdamW (0.9, 0.95), wd 0.1, linear warmup then cosine decay to
  10%, grad clip 1.0, 16 packed sequences of 256 tokens per step.  fp32,
  because bf16 autocast measured slower on this class of CPU.  The step count
  is chosen from measured throughput (2000-3200 tokens/s on 2 shared cores)
  so the full run (1500 steps, ~6.1M tokens, ~2 epochs) fits in <= 50 minutes.
* Output is assembled in a temp dir and renamed into place, so an interrupted
  run never leaves a half-written asset folder.
"""

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import OlmoeConfig, OlmoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "runtime", "assets", "default-moe")
EOS, PAD = "<|endoftext|>", "<|pad|>"
VOCAB_SIZE = 6144
SEQ_LEN = 256
BATCH = 16
MAX_FP16_BYTES = 32_000_000
KEEP_FILES = {"config.json", "model.safetensors", "generation_config.json"}


def build_tokenizer(train_docs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS, PAD],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for _, text in train_docs), trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1
    return tok


def encode_stream(tok, docs):
    """Concatenate documents as doc EOS doc EOS ... (packing; no BOS)."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch([text for _, text in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def make_config(num_layers, eos_id, pad_id, aux_coef=0.003):
    return OlmoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=num_layers,
        num_attention_heads=8, head_dim=32, num_key_value_heads=4,
        intermediate_size=112, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=False, router_aux_loss_coef=aux_coef, output_router_logits=True,
        tie_word_embeddings=False, max_position_embeddings=2048, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        experts_implementation="grouped_mm",  # measured ~30% faster than the eager loop on CPU
    )


def batches(stream, rng):
    """Endless shuffled batches of non-overlapping windows; a random start offset per epoch."""
    while True:
        offset = int(rng.integers(0, SEQ_LEN))
        n = (len(stream) - offset) // SEQ_LEN
        windows = stream[offset:offset + n * SEQ_LEN].reshape(n, SEQ_LEN)
        order = rng.permutation(n)
        for i in range(0, n - BATCH + 1, BATCH):
            yield torch.from_numpy(windows[order[i:i + BATCH]])


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_windows(stream):
    n = len(stream) // SEQ_LEN
    return torch.from_numpy(stream[:n * SEQ_LEN].reshape(n, SEQ_LEN))


@torch.no_grad()
def heldout_loss(model, windows, batch=32):
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        logits = model(input_ids=x, output_router_logits=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def unigram_loss(train_stream, heldout_stream):
    """Cross-entropy of held-out tokens under the (add-one) training unigram distribution."""
    counts = np.bincount(train_stream, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_stream[1:]].mean())


def set_top_k(model, k):
    model.config.num_experts_per_tok = k
    for layer in model.model.layers:
        layer.mlp.gate.top_k = k  # OlmoeTopKRouter reads self.top_k in forward


@torch.no_grad()
def routing_stats(model, windows, max_tokens=8192, batch=16):
    """Per-layer top-25% expert share at the trained top-k, and greedy agreement of top-2/top-1 drafts."""
    model.eval()
    windows = windows[: max(1, max_tokens // SEQ_LEN)]
    full_k = model.config.num_experts_per_tok
    num_experts = model.config.num_experts
    counts = [torch.zeros(num_experts, dtype=torch.long) for _ in model.model.layers]

    def hook(idx):
        def record(module, inputs, outputs):  # must return None, or it would replace the router output
            counts[idx].add_(torch.bincount(outputs[2].reshape(-1), minlength=num_experts))
        return record

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    preds = {}
    try:
        preds[full_k] = torch.cat([model(input_ids=windows[i:i + batch]).logits.argmax(-1) for i in range(0, len(windows), batch)])
    finally:
        for h in handles:
            h.remove()
    try:
        for k in (2, 1):
            set_top_k(model, k)
            preds[k] = torch.cat([model(input_ids=windows[i:i + batch]).logits.argmax(-1) for i in range(0, len(windows), batch)])
    finally:
        set_top_k(model, full_k)
    model.train()
    top_n = num_experts // 4
    shares = [round(float(c.sort(descending=True).values[:top_n].sum() / c.sum()), 4) for c in counts]
    return {
        "tokens": int(preds[full_k].numel()),
        "top25pct_expert_share_per_layer": shares,
        "experts_with_1pct_share_per_layer": [int((c.float() / c.sum() >= 0.01).sum()) for c in counts],
        "draft_agreement_top2": round(float((preds[2] == preds[full_k]).float().mean()), 4),
        "draft_agreement_top1": round(float((preds[1] == preds[full_k]).float().mean()), 4),
    }


def new_staging_dir(out_dir):
    """Staging folder next to the destination, so the final rename stays on one filesystem."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".default-moe-tmp-", dir=parent)


def save_assets(model, tok, record, staging, out_dir):
    model.config.output_router_logits = False  # a training-only switch; inference should not compute aux loss
    model.to(torch.float16).save_pretrained(staging)
    for name in os.listdir(staging):
        if name not in KEEP_FILES | {"training_log.jsonl"}:  # e.g. an index file save_pretrained may add
            path = os.path.join(staging, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    check_saved(staging)
    tok.save(os.path.join(staging, "tokenizer.json"))
    with open(os.path.join(staging, "training_record.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.chmod(staging, 0o755)  # mkdtemp and safetensors create owner-only modes; assets are meant to be shared
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), 0o644)
    old = None
    if os.path.exists(out_dir):  # swap, so the old folder is only dropped once the new one is in place
        old = out_dir + ".old-" + str(os.getpid())
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    if old:
        shutil.rmtree(old)


def check_saved(folder):
    """The runtime expects ONE safetensors file with per-expert fp16 tensors."""
    from safetensors import safe_open
    files = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    assert files == ["model.safetensors"], files
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, keys[:20]
        assert all(f.get_slice(k).get_dtype() == "F16" for k in keys)
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) <= MAX_FP16_BYTES + 1_000_000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--aux-coef", type=float, default=0.003, help="router load-balancing loss weight")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="~1 minute run into a temp dir")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 30
        args.log_every = 5
        if args.out == DEFAULT_OUT:
            args.out = tempfile.mkdtemp(prefix="default-moe-smoke-")

    t_start = time.time()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(2)

    train_docs = list(corpus.iter_documents("train"))
    heldout_docs = list(corpus.iter_documents("heldout"))
    tok = build_tokenizer(train_docs)
    train_stream = encode_stream(tok, train_docs)
    heldout_stream = encode_stream(tok, heldout_docs)
    print(f"corpus: train {len(train_docs)} docs {len(train_stream)} tokens; "
          f"held-out {len(heldout_docs)} docs {len(heldout_stream)} tokens; "
          f"tokenizer+encode {time.time() - t_start:.1f}s", flush=True)

    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    config = make_config(args.layers, eos_id, pad_id, args.aux_coef)
    model = OlmoeForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params * 2 <= MAX_FP16_BYTES, f"{n_params} params exceed the fp16 size limit"
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.train()

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(100, args.steps // 10))

    staging = new_staging_dir(args.out)  # everything is written here, then renamed into place
    try:
        log_path = os.path.join(staging, "training_log.jsonl")
        print(f"live log: {log_path}", flush=True)
        log = open(log_path, "w")
        data = batches(train_stream, rng)
        t_train = time.time()
        window_loss, window_n, last_loss = 0.0, 0, float("nan")
        for step in range(args.steps):
            lr = lr_at(step, args.steps, args.lr, warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            x = next(data)
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lm_loss = (out.loss - config.router_aux_loss_coef * out.aux_loss).item()
            window_loss += lm_loss
            window_n += 1
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                last_loss = window_loss / window_n
                elapsed = time.time() - t_train
                entry = {"step": step + 1, "loss": round(last_loss, 4), "aux_loss": round(out.aux_loss.item(), 4),
                         "lr": round(lr, 6), "grad_norm": round(float(grad_norm), 3),
                         "tokens_seen": (step + 1) * BATCH * SEQ_LEN, "elapsed_s": round(elapsed, 1),
                         "tokens_per_s": round((step + 1) * BATCH * SEQ_LEN / elapsed)}
                print(json.dumps(entry), flush=True)
                log.write(json.dumps(entry) + "\n")
                log.flush()
                window_loss, window_n = 0.0, 0
        train_time = time.time() - t_train
        log.close()

        windows = heldout_windows(heldout_stream)
        ho_loss = heldout_loss(model, windows)
        uni_loss = unigram_loss(train_stream, heldout_stream)
        routing = routing_stats(model, windows)
        print(f"held-out loss {ho_loss:.4f} (unigram baseline {uni_loss:.4f}); routing {json.dumps(routing)}", flush=True)

        record = {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": __import__("tokenizers").__version__,
            "seed": args.seed, "smoke": args.smoke,
            "corpus": {
                "source": "python stdlib .py sources + pydoc_data topics (tools/corpus.py)",
                "stdlib_dir": corpus.stdlib_dir(),
                "held_out_rule": f"sha1(relpath) % 100 < {corpus.HELD_OUT_PERCENT}",
                "train_files": len(train_docs), "train_tokens": int(len(train_stream)),
                "heldout_files": len(heldout_docs), "heldout_tokens": int(len(heldout_stream)),
                "heldout_relpaths": [rel for rel, _ in heldout_docs],
            },
            "training": {
                "steps": args.steps, "batch_sequences": BATCH, "seq_len": SEQ_LEN,
                "tokens_seen": args.steps * BATCH * SEQ_LEN,
                "epochs": round(args.steps * BATCH * SEQ_LEN / len(train_stream), 3),
                "optimizer": "AdamW(0.9,0.95) wd=0.1 clip=1.0", "peak_lr": args.lr, "warmup_steps": warmup,
                "schedule": "linear warmup, cosine to 10% of peak", "precision": "fp32",
                "train_wall_s": round(train_time, 1), "total_wall_s": round(time.time() - t_start, 1),
                "tokens_per_s": round(args.steps * BATCH * SEQ_LEN / train_time),
            },
            "final_train_loss": round(last_loss, 4),
            "heldout_loss": round(ho_loss, 4),
            "unigram_baseline_heldout_loss": round(uni_loss, 4),
            "routing": routing,
            "model": {
                "architecture": "OlmoeForCausalLM", "parameters": n_params, "fp16_bytes": n_params * 2,
                "vocab_size": VOCAB_SIZE, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim, "num_experts": config.num_experts,
                "num_experts_per_tok": config.num_experts_per_tok, "intermediate_size": config.intermediate_size,
                "norm_topk_prob": config.norm_topk_prob, "router_aux_loss_coef": config.router_aux_loss_coef,
                "eos_token_id": eos_id, "pad_token_id": pad_id,
            },
        }
        save_assets(model, tok, record, staging, args.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-written folder behind
        raise
    print(f"wrote {args.out} in {time.time() - t_start:.0f}s total", flush=True)


if __name__ == "__main__":
    main()
