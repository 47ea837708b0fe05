"""The MoE transformer forward pass, on NumPy or a device backend (runtime/kernels/backend.py).

One batched call serves prefill, single-token decode and multi-token verification: tokens [T] at
positions [start, start + T) attend to every cached position before them. Architecture details
(attention kind, q/k norm, RoPE, router, expert activation, shared experts) come from
`ModelConfig`; expert weights come from a provider. Every matrix product goes through the kernel
seam (`self.ops`, runtime/kernels): weights stay in their stored encoding, activations are float32.
Long prompts run in chunks of `PREFILL_CHUNK` tokens, so a pass's scratch memory is bounded.
On a device, short passes (decode, verification) take fused kernels where the ops offer them
(kernels/device.py): norms join the following product, residuals the preceding one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import numpy as np

from . import rope
from .attention import ATTENTION
from ..kernels import ExpertAct, select_ops
from ..kernels.backend import NUMPY, Backend, xp_of
from ..kernels.reference import silu
from ..kernels.stored import StoredMatrix
from .config import ModelConfig
from .draft_head import DraftHead, HeadOrder, head_order, load_token_ranks, permute_rows, ranks_file, select_rows, subset
from ..offload.experts import ExpertProvider
from .kv_cache import KVCache
from .loader import LoadedModel
from .routing import TARGET, LayerRouting, RoutingPolicy, RoutingRecord, restrict



PREFILL_CHUNK = 64  # tokens per pass of a long prompt: bounds attention scores and expert scratch
# ... and where every expert is resident and the memory allows (engine.py), as llama.cpp's
# ubatch: each expert's weights meet ~8x the tokens per read (OLMoE-1B-7B Q4_K_M, 2 threads:
# experts 66 -> 83 G products/s, prefill +10 %; docs/performance/peer.md)
WIDE_PREFILL_CHUNK = 512
_SLOTS = tuple(np.array([j], np.int32) for j in range(16))  # a decode token's j-th choice: row j (read-only)
for _a in _SLOTS:
    _a.flags.writeable = False


def _biased(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return y if bias is None else y + bias


class TimeSplit:
    """Accumulated seconds per part of the pass (attention, router, experts, lm_head). A decode
    token's MoE layer in one call (`MoEModel._moe_step`) counts under router, experts and all,
    except what it hands back to be streamed."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - t0


class _NoSplit:
    _none = nullcontext()  # one reusable no-op: a generator context per part cost ~20 us a pass

    def part(self, name: str):
        return self._none


class MoEModel:
    def __init__(self, loaded: LoadedModel, experts: ExpertProvider | None = None, backend: Backend = NUMPY,
                 ops=None):
        self.loaded = loaded
        self.config: ModelConfig = loaded.config
        self.backend = backend
        self.ops = ops or select_ops("auto", backend=backend)
        self.act = ExpertAct.of(self.config)
        # dense weights where the math runs (host: the loaded objects themselves, no copy); a tied
        # head is the embedding itself, uploaded once
        dense = loaded.load_dense()
        self.W = self._host = dense  # _host: what routing reads on the host (score biases)
        if backend.on_device:  # (not the joined q/k/v: the device multiplies the three separately)
            dense = {k: v for k, v in dense.items() if not k.endswith((".qkv", ".qkv_bias"))}
            uploaded: dict[int, object] = {}
            for v in dense.values():
                if id(v) not in uploaded:
                    uploaded[id(v)] = backend.to_device(v)
            self.W = {k: uploaded[id(v)] for k, v in dense.items()}
            self._host = {k: v for k, v in dense.items() if k.endswith("router_score_bias")}
            if backend.integrated:  # shared DRAM (Orin): a host copy would hold the same bytes twice
                loaded.dense, loaded.head_order = {}, None  # (read again, the rows come in token order)
        if experts is None:  # full residency, buffered reads: the plain reference configuration
            from ..offload.cache import ExpertCache
            from ..offload.store import ExpertStore

            experts = ExpertCache(ExpertStore(loaded, direct=False), capacity_bytes=None, place=backend.upload_expert)
        self.experts = experts
        self.prefill_chunk = PREFILL_CHUNK  # the most prompt tokens one pass runs (the plan's batch)
        self.cache_type = "f32"  # KV caches this model makes (model/kv_cache.py); runs default to f16
        self._inv_freq, self._rope_factor = rope.inv_freq_and_factor(self.config)
        self._attention_kind = ATTENTION[self.config.attention]
        self._rope_one: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # position -> its cos, sin
        self._all_visible = np.ones((1, 0), dtype=bool)  # `_visibility` of a decode token: every slot
        self._windows = {self.config.window_of(L) for L in range(self.config.num_layers)}  # GPT-OSS: sliding and full layers
        self.split: TimeSplit | _NoSplit = _NoSplit()
        self._draft_heads: dict[tuple[int, str], DraftHead] = {}
        # the order of the lm head's rows once a draft head shares them (`draft_head`): the host's
        # is the loaded weights' (every model on them shares it); a device's is what its upload copied
        self._device_order = loaded.head_order if backend.on_device else None
        # a decode token's MoE layer in one C call (`_moe_step`): where the CPU kernels, a cache
        # with a resident table, and a router they route like the reference (no groups, no score bias)
        self._steps = (hasattr(self.ops, "moe_step") and not backend.on_device
                       and hasattr(self.experts, "resident_table") and not self.config.expert_groups
                       and not any(name.endswith("router_score_bias") for name in self._host))
        self._router = getattr(self.ops, "router", self.ops.linear)  # the CPU kernels: `decode_pass`'s product
        # a decode token's whole pass in one C call (`_one_call`) where it applies; off: a layer per call
        self.one_call = True
        # `decode_pass`'s fixed arguments per layer ([]: it does not apply), and the weights they came from
        self._pass_layers: list | None = None
        self._pass_weights = None

    def draft_head(self, n: int, ranks_path: str | None = None) -> DraftHead | None:
        """The lm head over the ``n`` most frequent tokens (model/draft_head.py), built once per
        (n, ranks file): drafts of every decoder on this model share its rows. None for n = 0.
        A stored head on the host is permuted in place to rank order the first time, and the draft
        head is then a view of its first ``n`` rows: no bytes beside it (`draft_head_bytes`). A
        second ranks file, or a head on a device or in float, gets a copy of its rows. Build heads
        before decoding: the permutation rewrites the rows a pass reads."""
        if not n:
            return None
        V = self.config.vocab_size
        path = ranks_file(self.loaded.path, ranks_path)
        if (n, path) not in self._draft_heads:  # the file is read once per head
            ranks = load_token_ranks(path, V)
            ids = subset(ranks, n, V, path)
            lm, held = self.W["lm_head"], self._order
            if not self.backend.on_device and isinstance(lm, StoredMatrix) and (held is None or held.ranking == path):
                if held is None:
                    order = head_order(ranks, V)
                    # (in place: a tied embedding is this object too, and `_pass` looks it up by row)
                    self.W["lm_head"] = lm = permute_rows(lm, order)
                    self.loaded.head_order = held = HeadOrder(order, np.argsort(order), path)
                rows = StoredMatrix.checked_before(lm.data[:n * lm.row_bytes], lm.dtype, (n, lm.shape[1]))
                self._draft_heads[(n, path)] = DraftHead(held.order[:n].copy(), rows, V)
            else:
                where = ids if held is None else held.row[ids]  # (rows stored in another order)
                self._draft_heads[(n, path)] = DraftHead(ids, select_rows(lm, where, self.backend), V)
        return self._draft_heads[(n, path)]

    @property
    def _order(self):
        """The `HeadOrder` of the lm head's rows this model computes with, None in token order."""
        return self._device_order if self.backend.on_device else self.loaded.head_order

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.for_config(self.config, capacity, xp=self.backend.xp, cache_type=self.cache_type)

    # -- pieces -------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if positions.size != 1:
            return rope.tables(self._inv_freq, self._rope_factor, positions)
        # a decode token: drafts, their rollbacks and verification revisit the same positions
        at = int(positions[0])
        kept = self._rope_one.get(at)
        if kept is None:
            if len(self._rope_one) >= 4096:
                self._rope_one.clear()
            kept = rope.tables(self._inv_freq, self._rope_factor, positions)
            for a in kept:
                a.flags.writeable = False  # shared by every pass at this position
            self._rope_one[at] = kept
        return kept

    def _attention(self, L: int, x: np.ndarray, start: int, kv: KVCache, cos, sin, allowed) -> np.ndarray:
        return self._attention_kind(self.config, self.W, self.ops, L, x, start, kv, (cos, sin), allowed)

    def _moe(self, L: int, x: np.ndarray, policy: RoutingPolicy, record: RoutingRecord | None,
             norm=None) -> np.ndarray:
        """The routed (and shared) experts' output on ``x``. With ``norm`` (a device pass with fused
        kernels), ``x`` is the residual stream h: h + the experts on RMSNorm(h, norm)."""
        c, W, host = self.config, self.W, self._host
        p = f"layers.{L}."
        residual = None
        with self.split.part("router"):
            # routing runs on the host: the cache must know the experts before computing them
            if norm is None:
                logits = self._router(x, W[p + "router"], W.get(p + "router_bias"))
            else:  # the norm and the router in one launch
                residual, (x, logits) = x, self.ops.norm_linear(x, norm, c.rms_norm_eps, W[p + "router"],
                                                                W.get(p + "router_bias"))
            logits = self.backend.to_host(logits)  # [T, E]
            k = policy.k_for(L, c.top_k)
            stepped = self._moe_step(L, x, logits, k, policy) if self._steps and logits.shape[0] == 1 \
                and residual is None and not policy.selection_bias else None
            if stepped is None:
                bias = policy.selection_bias(L, logits) if policy.selection_bias else None
                groups = (c.expert_groups, c.expert_groups_used) if c.expert_groups else None
                experts, weights = self.ops.route(logits, k, c.router, c.norm_topk_prob, bias,
                                                  scale=c.routed_scaling_factor, groups=groups,
                                                  score_bias=host.get(p + "router_score_bias"))
                allowed = policy.allowed(L) if policy.allowed else None
                if allowed is not None:  # e.g. a draft restricted to resident experts: it never waits
                    experts, weights = restrict(experts, weights, logits, allowed, policy.fallback)
                out = None
            else:
                experts, weights, out = stepped  # out None: a choice not resident, streamed below
            if record is not None:
                record.layers[L] = LayerRouting(logits, experts, weights)
        grouped = residual is not None and not c.shared_expert_intermediate_size
        if out is None:
            with self.split.part("experts"):
                out = self._experts_grouped(L, x, experts, weights, residual) if grouped else \
                    self._experts(L, x, experts, weights)
        if c.shared_expert_intermediate_size:  # dense, resident: not through the expert cache
            with self.split.part("shared_experts"):
                out += self._dense_mlp(L, x, "shared_")
        return out if grouped or residual is None else residual + out

    def _moe_step(self, L: int, x: np.ndarray, logits: np.ndarray, k: int, policy: RoutingPolicy):
        """A decode token's routing, restriction and resident experts in one C call (kernels/cpu.py
        `moe_step`), with the cache's bookkeeping of what it computed. (experts, weights, out), out
        None when a choice is not resident; None where the step-by-step path decides."""
        c = self.config
        got = self.ops.moe_step(x, logits, k, c.router, c.norm_topk_prob, c.routed_scaling_factor,
                                policy.allowed(L) if policy.allowed else None, policy.fallback,
                                self.experts.resident_table(L, c.num_experts, self.ops.expert_args), self.act)
        if got is not None and got[2] is not None:
            self.experts.note_resident(L, sorted(e for e in got[0][0].tolist() if e >= 0))
        return got

    def _experts(self, L: int, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Tokens grouped by expert; each expert's weights fetched once for the whole pass. The
        resident experts are computed first, in one kernel call, while missing ones are read;
        then each group of fetched experts as it arrives.

        Reads land in whatever order the disk returns them, so each (token, choice) pair writes its
        own row of a [T·k, H] buffer and the k rows are summed in routing order at the end: the
        output, and so the next layer's routing, never depends on I/O timing (a replay or a rerun
        must route exactly as the original did)."""
        xp, dev = xp_of(x), self.backend.to_device
        T, k = experts.shape
        ids = experts[0].tolist() if T == 1 else None
        if ids is not None and not self.backend.on_device and k <= len(_SLOTS) and \
                len(set(ids)) == len(ids):  # a decode token (each distinct): slot j is its j-th choice
            mix = weights[0].astype(np.float32, copy=False)
            rows = {e: (_SLOTS[j], mix[j:j + 1]) for e, j in sorted((e, j) for j, e in enumerate(ids) if e >= 0)}
        elif experts.size <= 64:  # decode and verification: plain Python beats NumPy's per-call cost
            rows = {e: (dev(np.array(ts, np.int32)), dev(np.array(ws, np.float32)))
                    for e, (ts, ws) in sorted(_tokens_by_expert(experts, weights, flat=True).items())}
        else:
            flat = experts.ravel()
            order = np.argsort(flat, kind="stable")
            order = order[flat[order] >= 0]  # -1: a choice the policy dropped
            ids, starts = np.unique(flat[order], return_index=True)
            bounds = np.append(starts, order.size)
            slot_of = order.astype(np.int32)  # t·k + j: token t's j-th choice
            weight_of = weights.ravel()[order].astype(np.float32)
            rows = {int(e): (dev(slot_of[bounds[i]:bounds[i + 1]]), dev(weight_of[bounds[i]:bounds[i + 1]]))
                    for i, e in enumerate(ids)}
        xk = xp.repeat(x, k, axis=0)  # [T·k, H]: row t·k + j is token t's input for its j-th choice
        out = xp.zeros_like(xk)  # each row gets one expert's weighted output, added to 0: exact
        for group in self._fetch_groups(L, list(rows)):
            for _, w in group:
                self.backend.wait(w)  # its copy (device backends) may still be in flight
            self.ops.experts(xk, [(w, *rows[e]) for e, w in group], self.act, out)
        if T == 1 and not self.backend.on_device:  # the sum below, row by row in routing order: the same bits
            total = out[0:1]
            for j in range(1, k):
                total = total + out[j:j + 1]
            return total
        return out.reshape(T, k, -1).sum(axis=1)

    def _fetch_groups(self, L: int, ids: list[int]):
        """The layer's experts as groups of (id, weights): resident first, then as reads land."""
        resident = getattr(self.experts, "resident_group", None)
        group = resident(L, ids) if resident else None
        if group is not None:  # all resident (a draft's every pass): one group, no generator
            return [group] if group else []
        stream = getattr(self.experts, "stream", None)
        return stream(L, ids) if stream else [list(zip(ids, self.experts.get(L, ids)))]

    def _experts_grouped(self, L: int, x, experts: np.ndarray, weights: np.ndarray, residual):
        """``residual`` + the routed experts, on a device with fused kernels (kernels/device.py):
        one upload of the (token, weights) table and two launches (gate/up with SwiGLU, down with
        the weighted sum into the residual stream). For these short passes the experts are computed
        once every group has arrived: overlapping microseconds of compute with reads gains nothing,
        while a launch per group costs more."""
        found = _tokens_by_expert(experts, weights)
        got = [item for group in self._fetch_groups(L, sorted(found)) for item in group]
        for _, w in got:
            self.backend.wait(w)  # its copy may still be in flight
        if not got:
            return residual.copy()  # (every choice dropped: a new array all the same)
        return self.ops.experts_grouped(x, [(w, *found[e]) for e, w in got], self.act, residual)

    def _one_call_applies(self, policy: RoutingPolicy, kv: KVCache, head: DraftHead | None) -> bool:
        if not self.one_call:
            return False
        if self._pass_layers is None or self._pass_weights is not self.W:  # (built again for new weights)
            self._pass_layers, self._pass_weights = _one_call_layers(self), self.W
        c = self.config
        return (bool(self._pass_layers) and policy.selection_bias is None and isinstance(self.split, _NoSplit)
                and (head is None or _stored(head.weight)) and kv.cache_type in self.ops.kv_types
                and (not policy.layer_top_k or len({policy.k_for(L, c.top_k) for L in range(c.num_layers)}) == 1))

    def _one_call(self, h, kv: KVCache, start: int, cs, vis, policy: RoutingPolicy, rec: RoutingRecord | None,
                  head: DraftHead | None, first: int = 0):
        """A decode token's layers from ``first`` on and the head in one C call (kernels/cpu.py
        `decode_pass`), with the cache's bookkeeping of the layers it computed, as `_moe_step`
        keeps it. Returns (the first layer not done, logits [1, V] when none is left); ``h`` is
        then that layer's input."""
        c, E, n = self.config, self.config.num_experts, self.config.num_layers
        k = policy.k_for(0, c.top_k)
        table = self.experts.resident_table
        layers = [self._pass_layers[L] + (kv.keys[L], kv.values[L], table(L, E, self.ops.expert_args),
                                          policy.allowed(L) if policy.allowed else None) for L in range(first, n)]
        lm = self.W["lm_head"] if head is None else head.weight
        logits = np.empty((1, lm.shape[0]), np.float32)
        scores, weights = np.empty((n - first, E), np.float32), np.empty((n - first, k), np.float32)
        experts = np.empty((n - first, k), np.int64)
        done = self.ops.decode_pass(c, h, layers, cs, vis, start, k, policy.fallback == "best", self.act,
                                    self.W["norm"], lm, logits, scores, experts, weights)
        if rec is not None:
            for i in range(done):
                rec.layers[first + i] = LayerRouting(scores[i:i + 1], experts[i:i + 1], weights[i:i + 1])
        if done:
            self.experts.note_resident_keys([(first + i, e) for i, row in enumerate(experts[:done].tolist())
                                             for e in sorted(row) if e >= 0])
        return first + done, (logits if first + done == n else None)

    def _dense_mlp(self, L: int, x: np.ndarray, kind: str = "mlp_") -> np.ndarray:
        W, ops = self.W, self.ops
        p = f"layers.{L}.{kind}"
        return ops.linear(silu(ops.linear(x, W[p + "gate"])) * ops.linear(x, W[p + "up"]), W[p + "down"])

    def _visibility(self, start: int, T: int, pos: np.ndarray, tree_mask: np.ndarray | None,
                    window: int | None) -> np.ndarray:
        """[T, start + T] bool: which cache slots each new token attends to."""
        S = start + T
        if T == 1 and tree_mask is None and not window:  # a decode token sees every slot
            if self._all_visible.shape[1] < S:  # one read-only row, grown as needed, viewed per pass
                self._all_visible = np.ones((1, max(S, 2 * self._all_visible.shape[1])), dtype=bool)
                self._all_visible.flags.writeable = False
            return self._all_visible[:, :S]
        allowed = np.ones((T, S), dtype=bool)
        if tree_mask is None:
            allowed[:, start:] = np.tril(np.ones((T, T), dtype=bool))
        elif tree_mask.shape[1] == S:  # a full [T, S] mask (evaluation: draft beside target KV)
            allowed = np.array(tree_mask, dtype=bool)
        else:
            allowed[:, start:] = tree_mask
        if window:  # slot positions before `start` equal their RoPE positions (committed chain)
            slot_pos = np.concatenate([np.arange(start), pos])
            allowed &= slot_pos[None, :] > pos[:, None] - window
        return allowed

    # -- the pass -----------------------------------------------------------------------------
    def forward(
        self,
        tokens,
        kv: KVCache,
        start: int | None = None,
        policy: RoutingPolicy = TARGET,
        logits: str = "all",
        record: bool = True,
        positions=None,
        tree_mask: np.ndarray | None = None,
        head: DraftHead | None = None,
    ) -> tuple[np.ndarray, RoutingRecord | None]:
        """Run ``tokens`` in cache slots [start, start + T); ``start`` defaults to ``kv.filled``.

        For a chain, slot = position and attention is causal. For a token tree, ``positions``
        gives each token's RoPE position and ``tree_mask`` [T, T] which new tokens each may see
        (itself and its ancestors); every token sees all slots before ``start``. A [T, start + T]
        ``tree_mask`` instead says exactly which slots each token sees.
        Returns logits [T, V] (or [1, V] with ``logits="last"``) and the routing record.
        ``head``: a draft's head over a token subset; logits outside it are −inf.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        start = kv.filled if start is None else start
        chunk = self.prefill_chunk
        if tokens.size <= chunk or positions is not None or tree_mask is not None:
            return self._pass(tokens, kv, start, policy, logits, record, positions, tree_mask, head)
        # a long chain (a prompt): causal chunks, each attending to the ones before it
        outs, recs = [], []
        for i in range(0, tokens.size, chunk):
            last = i + chunk >= tokens.size
            out, rec = self._pass(tokens[i:i + chunk], kv, start + i, policy,
                                  logits if last else ("all" if logits == "all" else "none"), record, head=head)
            if out is not None:
                outs.append(out)
            recs.append(rec)
        return np.concatenate(outs), (RoutingRecord.concatenate(recs) if record else None)

    def _pass(self, tokens: np.ndarray, kv: KVCache, start: int, policy: RoutingPolicy, logits: str, record: bool,
              positions=None, tree_mask=None, head=None) -> tuple[np.ndarray | None, RoutingRecord | None]:
        c, W, ops = self.config, self.W, self.ops
        T = tokens.size
        kv.begin_write(start, T)
        if (not 0 <= int(tokens[0]) < c.vocab_size) if T == 1 else \
                (tokens.min(initial=0) < 0 or tokens.max(initial=0) >= c.vocab_size):
            raise ValueError(f"token id outside the vocabulary 0..{c.vocab_size - 1}")
        pos = np.arange(start, start + T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = self._rope(pos)
        masks = {w: self._visibility(start, T, pos, tree_mask, w) for w in self._windows}
        ranked = self._order
        # the embedding's rows: a tied head's are in rank order (looked up on the host, before any upload)
        ids = ranked.row[tokens] if ranked is not None and W["embed"] is W["lm_head"] else tokens
        if self.backend.on_device:  # the pass's host data goes up in one copy
            ids, (cos, sin), masks = self.backend.to_device_together([ids, [cos, sin], masks])
        rec = RoutingRecord() if record else None
        begin, end = getattr(self.experts, "begin_pass", None), getattr(self.experts, "end_pass", None)
        if begin:
            begin(T)
        fuse = T <= getattr(ops, "max_fused_tokens", 0)  # a device's fused kernels (kernels/device.py)
        block = fuse or getattr(ops, "attention_blocks", False)  # the CPU kernels' one-call attention block
        h = ops.embed(W["embed"], ids)
        # a decode token: its layers in one C call, which stops before a layer it cannot finish (an
        # expert to read); that layer goes step by step, and the call takes over again after it
        one = T == 1 and positions is None and tree_mask is None and logits != "none" and \
            self._one_call_applies(policy, kv, head)
        out, L = None, 0
        while L < c.num_layers:
            if one:
                L, out = self._one_call(h, kv, start, (cos, sin), masks[c.window_of(0)], policy, rec, head, L)
                if out is not None:
                    break
            with self.split.part("attention"):
                norm, mask = W[f"layers.{L}.attn_norm"], masks[c.window_of(L)]
                fused = ops.gqa_block(c, W, L, h, norm, start, kv, (cos, sin), mask) if block else None
                h = h + self._attention(L, ops.rms_norm(h, norm, c.rms_norm_eps), start, kv, cos, sin,
                                        mask) if fused is None else fused
            if fuse and c.moe_layers[L]:  # the norm joins the router's launch, the residual the experts'
                h = self._moe(L, h, policy, rec, W[f"layers.{L}.ffn_norm"])
            else:
                x = ops.rms_norm(h, W[f"layers.{L}.ffn_norm"], c.rms_norm_eps)
                if c.moe_layers[L]:
                    h = h + self._moe(L, x, policy, rec)
                else:
                    with self.split.part("dense_mlp"):
                        h = h + self._dense_mlp(L, x)
            L += 1
        if out is None and logits != "none":  # inner chunks of a prompt skip the head
            with self.split.part("lm_head"):
                if logits == "last":
                    h = h[-1:]
                lm = W["lm_head"] if head is None else head.weight
                if fuse:  # the final norm in the head's launch
                    out = ops.linear(h, lm, norm=(W["norm"], c.rms_norm_eps))
                else:
                    out = ops.linear(ops.rms_norm(h, W["norm"], c.rms_norm_eps), lm)
        if end:
            end()
        if out is None:
            return None, rec
        out = self.backend.to_host(out)  # logits to the host for sampling
        if head is None and ranked is not None:  # the head's rows in rank order: token order again
            return out.take(ranked.row, axis=1), rec  # (take: 3× faster than out[:, row] here)
        return (out if head is None else head.expand(out)), rec


def _one_call_layers(model: "MoEModel") -> list:
    """`decode_pass`'s fixed arguments of every layer, or [] where the one-call pass does not apply to
    the model: CPU kernels with `moe_step` (`_steps`), every layer MoE with one attention window, no
    shared experts, a router kind of the kernels', a stored head."""
    c, W, ops = model.config, model.W, model.ops
    if not (model._steps and hasattr(ops, "decode_pass") and all(c.moe_layers) and not c.shared_expert_intermediate_size
            and len({c.window_of(L) for L in range(c.num_layers)}) == 1 and _stored(W.get("lm_head"))
            and c.router in getattr(ops, "route_kinds", ())):
        return []
    layers = [ops.decode_layer_args(c, W, L) for L in range(c.num_layers)]
    return [] if None in layers else layers


def _stored(m) -> bool:
    return getattr(m, "dtype", "F32") != "F32" and hasattr(m, "type_id")


def _tokens_by_expert(experts: np.ndarray, weights: np.ndarray, flat: bool = False) -> dict[int, tuple[list, list]]:
    """expert id → (its tokens, their mixture weights), in token order; -1 (a dropped choice) skipped.
    ``flat``: t·k + j (the choice's row in a [T·k] layout) instead of the token t."""
    found: dict[int, tuple[list, list]] = {}
    k = experts.shape[1]
    for t, (row_e, row_w) in enumerate(zip(experts.tolist(), weights.tolist())):
        for j, (e, w) in enumerate(zip(row_e, row_w)):
            if e >= 0:
                found.setdefault(e, ([], []))[0].append(t * k + j if flat else t)
                found[e][1].append(w)
    return found
