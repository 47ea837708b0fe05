"""Mutation testing: inject known bugs one at a time into a scratch copy and check the suite fails.

Each mutation replaces one exact snippet of one file (the snippet must occur exactly once, else the
mutation is reported as ``stale``: the code moved, update the list) and runs pytest on the tests
most likely to catch it (``--full``: the whole suite). A mutation is ``caught`` when pytest fails
(or errors, or times out), ``survived`` when it passes. The repository itself is never touched:
the copy lives under a temporary folder, importable as ``s2moe`` through a small shim
(``s2moe/runtime`` → ``runtime/`` and so on, as pyproject's package-dir maps them) on PYTHONPATH.

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = {"runtime": "runtime", "calib": "calib", "csrc": "csrc"}  # s2moe/<name> → <folder>


@dataclass
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    tests: list[str]  # pytest arguments: files, node ids, or "-k", "expr"
    note: str = ""
    # a snippet whose presence in the file makes the mutation equivalent (no behaviour can change):
    # reported as "equivalent", not as survived; the mutation becomes live when the snippet goes
    equivalent_if: str = ""
    equivalent_why: str = ""


T_SAMPLED = ["tests/test_sampled_speculation.py"]
T_LAW = ["tests/test_sampled_speculation.py", "-k", "target_law"]
T_GREEDY = ["tests/test_speculative.py", "-k", "greedy_methods_equal_ar"]
T_KV = ["tests/test_speculative.py::test_greedy_tree_accepts_the_second_branch_and_moves_its_kv",
        "tests/test_kv_cache.py", "tests/test_speculative.py::test_committed_kv_equals_fresh_prefill",
        "tests/test_properties.py::test_committed_kv_equals_fresh_prefill"]
T_RG = ["tests/test_speculative.py", "-k", "reuse_gating"]
T_SAMPLING = ["tests/test_sampling.py"]
T_POLICY = ["tests/test_cache_policy.py"]
T_ST = ["tests/test_reliability.py", "tests/test_fuzz.py", "-k", "safetensors"]
T_GGUF = ["tests/test_reliability.py", "-k", "gguf"]
T_PROFILE = ["tests/test_reliability.py", "-k", "profile"]
T_EXPORT = ["tests/test_calib.py", "-k", "export"]
T_ADMIT = ["tests/test_admit_rules.py"]
T_INDEX = ["tests/test_reliability.py", "-k", "index or sharded"]

SPEC = "runtime/decoding/speculative.py"
ST = "runtime/model/formats/safetensors_index.py"
GGUF = "runtime/model/formats/gguf_index.py"
CACHE = "runtime/offload/cache.py"
SPEC_OPTIONS = "runtime/cli/spec_options.py"

MUTATIONS: list[Mutation] = [
    # -- the ten bugs of issue 13 -------------------------------------------------------------------
    Mutation("accept-always", SPEC, "if rng.random() < min(1.0, p[token] / q[token]):", "if True:", T_LAW,
             "stochastic verification accepts every draft token"),
    Mutation("residual-is-p", SPEC, "residual = np.maximum(p - q, 0.0)", "residual = p.copy()", T_LAW,
             "on rejection, resample from p instead of max(p - q, 0)"),
    Mutation("accept-q-over-p", SPEC, "min(1.0, p[token] / q[token])", "min(1.0, q[token] / p[token])", T_LAW,
             "accept with q/p"),
    Mutation("seed-ignored", SPEC, "rng = np.random.default_rng(self.params.seed)", "rng = np.random.default_rng()",
             T_SAMPLED + ["-k", "seed"], "the sampling seed ignored (speculative decoding)"),
    Mutation("lfu-decay-removed", CACHE,
             "return self.count[key] * 0.5 ** ((self.clock - self.last.get(key, self.clock)) / self.half_life)",
             "return self.count[key]", T_POLICY, "LFU counts never decay"),
    Mutation("fingerprint-check-disabled", SPEC_OPTIONS,
             'matches = prof.data["model"]["fingerprint"] == model_fingerprint(loaded)', "matches = True", T_PROFILE,
             "a profile made for another model is taken as this model's"),
    Mutation("safetensors-overlap-check-removed", ST, "        if b1 < e0:\n", "        if False:\n", T_ST,
             "overlapping safetensors tensors accepted"),
    Mutation("recursion-guard-removed", ST, "except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:",
             "except (UnicodeDecodeError, json.JSONDecodeError) as exc:", T_ST, "a nested-JSON bomb crashes the CLI"),
    Mutation("gguf-duplicate-check-removed", GGUF, "            if name in self.tensors:\n",
             "            if False:\n", T_GGUF,
             "duplicate GGUF tensor names accepted",
             equivalent_if="self.reader = GGUFReader(path",
             equivalent_why="gguf's GGUFReader refuses duplicate names before this check runs"),
    Mutation("gguf-overlap-check-removed", GGUF, "        if b1 < e0:\n", "        if False:\n", T_GGUF,
             "overlapping GGUF tensors accepted"),
    Mutation("export-bandwidth-inverted", "calib/fit_export.py", '"prune_bandwidth": round(mib / t_exp, 6)',
             '"prune_bandwidth": round(t_exp / mib, 6)', T_EXPORT, "measured profile exported with T_exp / MiB"),
    # -- sampling, acceptance, residual, seeds ------------------------------------------------------
    Mutation("seed-ignored-ar", "runtime/decoding/generate.py", "rng = np.random.default_rng(params.seed)",
             "rng = np.random.default_rng()", T_SAMPLED + ["-k", "seed"], "the sampling seed ignored (AR)"),
    Mutation("bonus-from-root-row", SPEC, "return len(d.tokens), sample(logits[rows[-1]], self.params, rng)",
             "return len(d.tokens), sample(logits[rows[0]], self.params, rng)", T_LAW,
             "the bonus token sampled from the root's row"),
    Mutation("bonus-from-draft", SPEC, "return len(d.tokens), sample(logits[rows[-1]], self.params, rng)",
             "return len(d.tokens), (int(rng.choice(d.dists[-1].size, p=d.dists[-1])) if d.dists and "
             "d.dists[-1] is not None else sample(logits[rows[-1]], self.params, rng))", T_LAW,
             "the bonus token drawn from the last draft distribution"),
    Mutation("residual-from-q", SPEC, "residual = np.maximum(p - q, 0.0)", "residual = np.maximum(q - p, 0.0)",
             T_LAW, "residual max(q - p, 0)"),
    Mutation("accept-inverted", SPEC, "if rng.random() < min(1.0, p[token] / q[token]):",
             "if rng.random() >= min(1.0, p[token] / q[token]):", T_LAW, "accept with 1 - min(1, p/q)"),
    Mutation("confidence-law-unrestricted", SPEC, "dist = np.where(dist >= s.confidence_threshold, dist, 0.0)",
             "dist = np.where(dist >= 0, dist, 0.0)", T_LAW,
             "confidence drafts verified against the unconditioned q (the bias fixed in issue 13)"),
    Mutation("confidence-threshold-ignored", SPEC, 'if m.admit == "confidence" and prob < s.confidence_threshold:',
             'if m.admit == "confidence" and prob < 0:', T_LAW, "the confidence rule admits every token"),
    Mutation("temperature-ignored", "runtime/decoding/sampling.py",
             "z = logits.astype(np.float64) / params.temperature", "z = logits.astype(np.float64)", T_SAMPLING,
             "temperature not applied"),
    Mutation("top-k-drops-ties", "runtime/decoding/sampling.py", "keep &= p >= kth", "keep &= p > kth", T_SAMPLING,
             "top-k excludes the k-th token"),
    Mutation("top-p-one-more", "runtime/decoding/sampling.py",
             "cutoff = np.searchsorted(cum, params.top_p - 1e-12) + 1",
             "cutoff = np.searchsorted(cum, params.top_p - 1e-12) + 2", T_SAMPLING, "top-p keeps one token too many"),
    Mutation("min-p-absolute", "runtime/decoding/sampling.py", "keep &= p >= params.min_p * p.max()",
             "keep &= p >= params.min_p", T_SAMPLING, "min-p not relative to the top probability"),
    # -- greedy acceptance, KV rollback and commit --------------------------------------------------
    Mutation("greedy-emits-draft", SPEC, "return i, int(np.argmax(parent))", "return i, token", T_GREEDY,
             "on a greedy mismatch the draft token is emitted instead of the target's"),
    Mutation("tree-kv-not-moved", SPEC, "kv.keep(slots, P)  # the accepted path's target-computed KV, moved into place",
             "kv.rollback(P + 1 + a)", T_KV, "the accepted tree branch's KV is not moved into place"),
    Mutation("final-rollback-skipped", SPEC, "kv.rollback(min(kv.length, len(prompt) + len(out) - 1))", "kv.length",
             T_KV, "KV of tokens accepted past max_tokens stays committed"),
    Mutation("commit-one-short", SPEC, "kv.commit(P + 1 + a)", "kv.commit(P + a)", T_KV,
             "the last accepted position's KV is not committed"),
    Mutation("kv-rollback-keeps-length", "runtime/model/kv_cache.py", "self.length = min(self.length, to)",
             "self.length = self.length", T_KV, "rollback below the committed length keeps it committed"),
    Mutation("kv-gap-allowed", "runtime/model/kv_cache.py", "if not 0 <= start <= self.filled:",
             "if not 0 <= start:", ["tests/test_kv_cache.py"], "a KV write may leave a gap"),
    Mutation("kv-keep-no-copy", "runtime/model/kv_cache.py",
             "a[:, at:at + len(slots)] = a[:, slots]  # fancy indexing copies first: overlap-safe", "pass", T_KV,
             "kv.keep moves nothing"),
    # -- admit rules, cost model, reuse-aware gating, routing ---------------------------------------
    Mutation("utility-threshold-inverted", SPEC, "                if utility < s.utility_threshold:\n",
             "                if utility > s.utility_threshold:\n",
             ["tests/test_speculative.py", "-k", "utility_rule"], "AE admits exactly what it should refuse"),
    Mutation("marginal-cost-ignores-residency", SPEC,
             "return sum(costs.expert_cost(state(key)) for key in new_experts)",
             'return sum(costs.expert_cost("missing") for key in new_experts)',
             ["tests/test_speculative.py", "-k", "marginal_cost"], "resident experts cost a fetch"),
    Mutation("rg-never-applied", SPEC, "        if not self.method.reuse_gating:\n            return TARGET",
             "        if True:\n            return TARGET", T_RG, "s2moe verifies without reuse-aware gating"),
    Mutation("rg-importance-sign", "runtime/decoding/gating.py", "g = (w[:, None] * logits).sum(0)  # [E]",
             "g = -(w[:, None] * logits).sum(0)  # [E]", T_RG, "RG prefers the experts the batch wants least"),
    Mutation("rg-gap-off-by-one", "runtime/decoding/gating.py", "gap = ordered[:, 0] - ordered[:, k]",
             "gap = ordered[:, 0] - ordered[:, k - 1]", T_RG, "lambda from the k-th instead of the (k+1)-th logit"),
    Mutation("rg-variants-swapped", "runtime/decoding/gating.py",
             'lam = self.strength * (np.full(B, gap.mean()) if self.variant == "code" else gap)',
             'lam = self.strength * (gap if self.variant == "code" else np.full(B, gap.mean()))', T_RG,
             "the paper's per-token lambda and the code's batch mean swapped"),
    Mutation("routing-no-renormalise", "runtime/model/routing.py", "        if norm_topk_prob:\n",
             "        if False:\n", ["tests/test_routing.py", "tests/test_reference_logits.py"],
             "norm_topk_prob ignored"),
    Mutation("expert-weights-fp16", "runtime/offload/experts.py",
             "        return StoredMatrix(raw, ref.dtype, tuple(ref.shape))\n",
             "        return StoredMatrix.from_float(_float(ref, raw).astype(np.float16).astype(np.float32))\n",
             ["tests/test_reference_logits.py"], "expert weights rounded to fp16 on read (a 2e-5 logit error)"),
    Mutation("ae-selected-not-updated", SPEC, "                selected |= new\n", "                selected = selected\n",
             T_ADMIT, "ΔC_ver counts experts earlier drafts already bring"),
    Mutation("ae-prefix-not-multiplied", SPEC, "            prefix *= prob\n", "            prefix = prefix\n",
             T_ADMIT, "U_i uses the token's probability, not the prefix probability"),
    Mutation("ae-backoff-not-doubling", SPEC, "min(2 * self._wait, 16)", "min(self._wait, 16)", T_ADMIT,
             "AE backs off one AR step at a time"),
    Mutation("confidence-uses-prefix", SPEC, 'if m.admit == "confidence" and prob < s.confidence_threshold:',
             'if m.admit == "confidence" and prefix * prob < s.confidence_threshold:', T_ADMIT,
             "the confidence rule thresholds the prefix probability"),
    # -- cache policy -------------------------------------------------------------------------------
    Mutation("lfu-heap-without-decay", CACHE,
             "entry = (math.log2(count) + last / self.half_life if count > 0 else -math.inf, last, key)",
             "entry = (math.log2(count) if count > 0 else -math.inf, last, key)", T_POLICY,
             "the LFU heap orders by undecayed counts"),
    Mutation("lfu-admits-everything", CACHE, "return self._score(key) > self._score(victim)", "return True",
             T_POLICY, "LFU admission always evicts"),
    Mutation("lru-evicts-most-recent", CACHE, "return next((k for k in self.order if k not in protected), None)",
             "return next((k for k in reversed(self.order) if k not in protected), None)", T_POLICY,
             "LRU evicts the most recently used"),
    Mutation("lru-hit-not-recorded", CACHE, "touch = insert  # a hit", "touch = access  # a hit", T_POLICY,
             "an LRU hit does not refresh recency"),
    Mutation("cache-evicts-protected", CACHE, "victim = self.policy.victim(protected | self.pinned)",
             "victim = self.policy.victim(self.pinned)", T_POLICY,
             "an expert the current pass needs can be evicted"),
    Mutation("cache-over-budget", CACHE, "while self.resident_bytes + size > self.capacity:",
             "if self.resident_bytes + size > self.capacity:", T_POLICY,
             "one eviction per insertion, whatever the size"),
    # -- parsers' checks ----------------------------------------------------------------------------
    Mutation("safetensors-header-vs-file-size", ST, "if n > _MAX_HEADER or 8 + n > size:", "if n > _MAX_HEADER:",
             T_ST, "a header longer than the file is read as JSON"),
    Mutation("safetensors-dtype-check-removed", ST, "if dtype not in PLAIN_DTYPES:", "if False:", T_ST,
             "unknown dtypes reach the decoder"),
    Mutation("safetensors-integer-check-removed", ST,
             "if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shape, begin, end)):",
             "if False:", T_ST, "float/bool shapes and offsets accepted"),
    Mutation("safetensors-extent-check-removed", ST, "if data_start + end > size:", "if False:", T_ST,
             "tensors past the end of the file accepted"),
    Mutation("safetensors-size-check-removed", ST, "if not 0 <= begin <= end or end - begin != expected:",
             "if not 0 <= begin <= end:", T_ST, "offsets that do not hold the shape accepted"),
    Mutation("gguf-count-precheck-removed", GGUF,
             "if n_tensors * _MIN_TENSOR_INFO > room or n_kv * _MIN_KV > room:", "if False:",
             T_GGUF + ["tests/test_fuzz.py::test_absurd_tensor_count_is_refused_at_once"],
             "absurd GGUF counts reach the reader"),
    Mutation("gguf-length-check", GGUF, "if n < 0 or self.pos + n > self.size:", "if n < 0:", T_GGUF,
             "a GGUF string length past the end is not refused before reading"),
    Mutation("gguf-duplicate-key-check-removed", GGUF, "                if key in fields:\n",
             "                if False:\n", T_GGUF, "duplicate GGUF metadata keys accepted"),
    Mutation("safetensors-object-check-removed", ST, "if not isinstance(header, dict):", "if False:", T_ST,
             "a JSON list as header crashes the parser"),
    Mutation("safetensors-negative-dim-check-removed", ST, "if any(d < 0 for d in shape):", "if False:", T_ST,
             "negative dimensions reach the size arithmetic"),
    Mutation("index-missing-shard", ST, "        if not os.path.exists(path):\n", "        if False:\n",
             T_INDEX, "an index naming a missing shard is not named in the error"),
    Mutation("index-listed-tensor-absent", ST, "        if missing:\n", "        if False:\n", T_INDEX,
             "a tensor listed in the index but absent from its shard is ignored"),
    # -- profile checks -----------------------------------------------------------------------------
    Mutation("fingerprint-refuse-ignored", SPEC_OPTIONS,
             'if prof.data["model"].get("fingerprint_policy") == "refuse":', "if False:", T_PROFILE,
             "fingerprint_policy: refuse only warns"),
    Mutation("profile-hot-list-kept-for-other-model", SPEC_OPTIONS,
             "    elif hot is None and prof.hot_experts:\n", "    if hot is None and prof.hot_experts:\n", T_PROFILE,
             "another model's hot list pinned"),
    Mutation("profile-bandwidth-may-be-zero", "runtime/profile.py", '"bandwidth_mb_s": _pos, "latency_us": _nonneg',
             '"bandwidth_mb_s": _nonneg, "latency_us": _nonneg', ["tests/test_calib.py", "-k", "malformed"],
             "a zero bandwidth accepted"),
    Mutation("fingerprint-ignores-bytes", "runtime/profile.py", "            h.update(f.read(1 << 20))\n",
             "            f.read(1 << 20)\n", ["tests/test_reliability.py", "-k", "fingerprint"], "two models with the same shapes share a fingerprint"),
    Mutation("export-expert-mib-as-mb", "calib/fit_export.py", 'mib = m["expert_bytes_stored"] / MIB',
             'mib = m["expert_bytes_stored"] / 1e6', T_EXPORT, "expert size exported in MB, not MiB"),
    # interop, serve, new-user defects (issues 17, 18)
    Mutation("gguf-kv-heads-not-repeated", "runtime/model/formats/gguf_writer.py",
             'return c.arch == "olmoe" and c.qk_norm == "full" and c.num_kv_heads < c.num_heads', "return False",
             ["tests/test_interop.py"], "grouped-query OLMoE exported with a k_norm llama.cpp refuses"),
    Mutation("gguf-unrepeat-takes-wrong-copy", "runtime/model/dense.py",
             "return np.arange(rows).reshape(-1, repeat, head_dim)[:, 0].reshape(-1)",
             "return np.arange(rows).reshape(repeat, -1, head_dim)[0].reshape(-1)",
             ["tests/test_interop.py", "-k", "same_logits"], "repeated KV heads read back in the wrong order"),
    Mutation("pre-tokenizer-always-default", "runtime/model/formats/gguf_tokenizer.py",
             'w.add_tokenizer_pre(pre or "default")', 'w.add_tokenizer_pre("default")',
             ["tests/test_interop.py", "-k", "pre_tokenizer"], "llama.cpp told to split text its own way"),
    Mutation("hub-revision-ignored", "runtime/model/hub.py", "snapshot_download(repo, revision=revision,",
             "snapshot_download(repo, revision=None,", ["tests/test_hub.py"], "--model org/name@rev reads main"),
    Mutation("serve-disconnect-ignored", "runtime/serve/app.py",
             "            finally:  # the client went away (or the stream ended): a running job stops at its next token\n"
             "                job.cancelled.set()",
             "            finally:\n                pass", ["tests/test_serve.py", "-k", "disconnect"],
             "a client that went away keeps the decoder busy"),
    Mutation("serve-stop-string-kept", "runtime/serve/worker.py", "self.stopped, text = True, text[: min(hits)]",
             "self.stopped = True", ["tests/test_serve.py", "-k", "stop"], "the stop string left in the text"),
    Mutation("convert-overwrites-input", "runtime/outputs.py",
             "if os.path.exists(inp) and os.path.samefile(path, inp):", "if False:",
             ["tests/test_user_errors.py", "-k", "input"], "convert writes over its own model"),
    Mutation("live-costs-never-restart", "runtime/decoding/live_costs.py", "if self.off_run >= self.RUN:",
             "if False:", ["tests/test_live_costs.py"], "a slowed disk averaged away over many passes"),
    Mutation("live-costs-not-used", SPEC,
             "# nothing to learn where none was used\n                self.costs = self.live.current()",
             "# nothing to learn where none was used\n                pass", ["tests/test_live_costs.py", "-k", "decoder_uses"], "AE keeps the stale constants"),
    Mutation("predict-misses-priced-as-hits", "calib/predict.py", "costs.t_exp_miss * m + costs.t_exp_hit * h",
             "costs.t_exp_hit * (m + h)", ["tests/test_predict.py"], "a replay that ignores the slow tier"),
    Mutation("trace-drops-repeat-layers", "runtime/offload/cache.py",
             "self.trace[-1][2].extend(k for k in dict.fromkeys(keys) if k not in self._pass_keys)",
             "self.trace[-1][2].extend(keys[:1])", ["tests/test_predict.py"], "a trace missing a pass's experts"),
    Mutation("context-not-enforced", "runtime/cli/run.py", "    if prompt_tokens + max_tokens > context:",
             "    if False:", ["tests/test_user_errors.py", "-k", "context"], "-n past the context runs on"),
    Mutation("pass-log-features-swapped", "runtime/decoding/pass_log.py",
             "for n, miss, hit, s in samples", "for n, hit, miss, s in samples",
             ["tests/test_profile_update.py", "-k", "records_its_passes"], "recorded misses written as hits"),
    Mutation("update-takes-any-budget", "calib/update.py", "        if log.get(field) != want:",
             "        if field != \"budget\" and log.get(field) != want:",
             ["tests/test_profile_update.py", "-k", "refuses"], "a profile refitted from a run at another budget"),
    Mutation("c-draft-timed-with-fetches", "calib/profile_cmd.py",
             "    return RoutingPolicy(top_k=draft_k, allowed=lambda L: resident(L, E), fallback=\"best\")",
             "    return RoutingPolicy(top_k=draft_k)", ["tests/test_calib_inputs.py", "-k", "c_draft_without_fetches"],
             "C_draft timed with a draft that fetches its absent experts (the run's never does)"),
    Mutation("controlled-weight-fixed", "calib/profile_cmd.py", "        weight = min(cv, key=lambda w: (cv[w], -w))",
             "        weight = CONTROLLED_WEIGHT", ["tests/test_replay.py", "-k", "cross_validation"],
             "the controlled passes' weight not chosen by cross-validation"),
    Mutation("validate-ignores-drift", "calib/validate_cmd.py",
             "    scale = float(np.median(y / np.maximum(model.predict(X), 1e-12)))", "    scale = 1.0",
             ["tests/test_replay.py", "-k", "slowed_down"], "validate's drift-adjusted score not adjusted"),
    Mutation("capture-ignores-prefetch", "calib/replay.py", "        if cache.prefetching:", "        if False:",
             ["tests/test_replay.py", "-k", "prefetch"], "a capture that keeps passes with reads in flight"),
    Mutation("read-buffer-reused-while-viewed", "runtime/offload/reader.py",
             "        weakref.finalize(arr, self._give_back, mm, size).atexit = False", "        self._give_back(mm, size)",
             ["tests/test_offload.py"], "a read buffer recycled while an expert still views it"),
    Mutation("read-buffer-pool-unbounded", "runtime/offload/reader.py",
             "            if self.free_bytes + self.outstanding + size <= self.limit:", "            if True:",
             ["tests/test_offload.py", "-k", "limit"], "freed read buffers kept past the plan"),
    Mutation("emulated-wait-spins", "runtime/offload/store.py", "        time.sleep(left)\n",
             "        pass\n", ["tests/test_offload.py", "-k", "emulated"], "an emulated link that burns a core while it waits"),
    Mutation("inflight-priced-as-hit", "runtime/decoding/cost_model.py",
             "            return self.t_exp_hit + self.t_exp_inflight", "            return self.t_exp_hit",
             ["tests/test_speculative.py", "-k", "marginal_cost"], "AE pricing a prefetch still reading as resident"),
    Mutation("prefetch-wait-not-observed", SPEC, "                self.live.observe_prefetch_wait(used, pre_wait)",
             "                pass", ["tests/test_live_costs.py", "-k", "in_flight"],
             "live costs that never learn how long verification waits for prefetches"),
    Mutation("pin-on-any-lead", "calib/hot.py", "        if mean > 2 * se:", "        if mean > 0:",
             ["tests/test_hot.py"], "a hot list pinned for a lead within the held-out split's noise"),
    Mutation("never-pin", "calib/hot.py", "            chosen = pinned\n", "            pass\n",
             ["tests/test_hot.py"], "a profile that never pins, even where pinning clearly wins"),
    Mutation("hot-list-sorted-by-key", "calib/hot.py", '"gpu_experts": [list(k) for k in pinned]',
             '"gpu_experts": [list(k) for k in sorted(pinned)]', ["tests/test_hot.py"],
             "a hot list whose head is layer 0, not the most used experts"),
    Mutation("pass-log-prefetched-as-misses", SPEC,
             "(len(tokens), missing - used, resident + used, took - pre_wait)",
             "(len(tokens), missing, resident, took)",
             ["tests/test_profile_update.py"], "recorded passes that count prefetched experts as cold misses"),
    # -- a second set, found by a read-only review (session 2026-12-01): each had survived the suite --
    Mutation('softmax-no-max-shift', 'runtime/decoding/sampling.py',
             '    z -= z.max()\n',
             '    pass\n',
             ['tests/test_sampling.py'], 'sampling probabilities overflow to NaN at low temperature (no max subtracted)'),
    Mutation('top-k-one-ignored', 'runtime/decoding/sampling.py',
             'if params.top_k and params.top_k < p.size:',
             'if params.top_k > 1 and params.top_k < p.size:',
             ['tests/test_sampling.py'], '--top-k 1 treated as no top-k'),
    Mutation('draft-samples-untempered', SPEC,
             'q = probabilities(logits, self.params)',
             'q = softmax(logits.astype(np.float64))',
             ['tests/test_sampled_speculation.py', '-k', 'truncated_law'], 'the draft samples plain softmax, ignoring temperature and truncation (lossless, accepts less)'),
    Mutation('admit-prob-untruncated', SPEC,
             'return token, float(q[token]), q',
             'return token, float(softmax(logits.astype(np.float64))[token]), q',
             ['tests/test_sampled_speculation.py', '-k', 'target_law'], 'the confidence rule reads the untruncated probability: a biased law under T or top-k'),
    Mutation('accept-ratio-uses-token-prob', SPEC,
             'if rng.random() < min(1.0, p[token] / q[token]):',
             'if rng.random() < min(1.0, p[token] / d.token_probs[i]):',
             ['tests/test_sampled_speculation.py', '-k', 'target_law'], 'acceptance divides by the unconditioned draft probability under the confidence rule'),
    Mutation('cli-seed-zero-is-random', 'runtime/cli/run.py',
             'None if seed is None or seed == -1 else seed',
             'None if not seed or seed == -1 else seed',
             ['tests/test_default_model.py', 'tests/test_cli.py', '-k', 'gguf_export or streams_text'], '--seed 0 draws a fresh random seed'),
    Mutation('serve-seed-ignored', 'runtime/serve/app.py',
             'req.seed if req.seed is not None and req.seed >= 0 else None',
             'None',
             ['tests/test_serve.py', '-k', 'seed'], "the server drops a request's seed"),
    Mutation('lfu-admit-on-stale-counts', 'runtime/offload/cache.py',
             'return self._score(key) > self._score(victim)',
             'return self.count[key] > self.count[victim]',
             ['tests/test_cache_policy.py'], 'LFU admission on stored, not decayed-to-now, counts'),
    Mutation('fingerprint-ignores-sampled-chunks', 'runtime/profile.py',
             '                h.update(f.read(64 << 10))\n',
             '                f.read(64 << 10)\n',
             ['tests/test_reliability.py', '-k', 'fingerprint'], 'the fingerprint hashes only the first MiB of a large file'),
    Mutation('profile-hot-list-overrides-users', 'runtime/cli/spec_options.py',
             '    elif hot is None and prof.hot_experts:\n',
             '    elif prof.hot_experts:\n',
             ['tests/test_user_errors.py', '-k', 'hot_list'], "a profile's hot list replaces the user's --hot-experts"),
    Mutation('safetensors-header-length-off-by-8', 'runtime/model/formats/safetensors_index.py',
             'if n > _MAX_HEADER or 8 + n > size:',
             'if n > _MAX_HEADER or n > size:',
             ['tests/test_reliability.py', '-k', 'safetensors_header'], 'a header running up to 8 bytes past the end of the file accepted'),
    Mutation('gguf-overlap-scan-unsorted', 'runtime/model/formats/gguf_index.py',
             '        spans.sort()\n',
             '',
             ['tests/test_reliability.py', '-k', 'gguf'], 'a GGUF whose tensor table is not in offset order refused as overlapping'),
    Mutation('kv-trim-everything-refused', 'runtime/model/kv_cache.py',
             'if not 0 <= n <= self.filled:',
             'if not 0 <= n < self.filled:',
             ['tests/test_kv_cache.py'], 'trim(filled) refused (off by one)'),
    Mutation('topk-large-path-ties-unfixed', 'runtime/model/routing.py',
             '    if ties_outside.any():\n',
             '    if False:\n',
             ['tests/test_routing.py'], 'top-k over >4096 scores leaves a tied lower expert id out'),
    Mutation('odirect-short-read-ignores-head', 'runtime/offload/reader.py',
             'if got < head + nbytes:',
             'if got < nbytes:',
             ['tests/test_faults.py', '-k', 'short'], 'an O_DIRECT read short by less than its alignment head accepted'),
    Mutation('export-zero-miss-time-divides', 'calib/fit_export.py',
             't_exp = c["t_exp_miss_ms"] or 1e-9',
             't_exp = c["t_exp_miss_ms"]',
             ['tests/test_calib.py', '-k', 'export'], 'export of a profile with T_exp miss 0 divides by zero'),
    # -- a third set, from a second read-only review: each had passed its targeted tests --
    Mutation('ae-predict-gap-off-by-one', SPEC,
             'gap = ordered[0] - ordered[min(self.top_k, row.shape[1] - 1)]',
             'gap = ordered[0] - ordered[min(self.top_k - 1, row.shape[1] - 1)]',
             ['tests/test_residency_gating.py'], "AE predicts gating's raise from the top-1 - k-th gap, not the (k+1)-th"),
    Mutation('ae-predict-favours-other-layers', SPEC,
             'favoured[[e for layer, e in batch if layer == L]] = True',
             'favoured[[e for layer, e in batch]] = True',
             ['tests/test_residency_gating.py'], "AE's predicted gating favours batch experts of every layer"),
    Mutation('ae-backoff-cap-8', SPEC,
             'min(2 * self._wait, 16)',
             'min(2 * self._wait, 8)',
             ['tests/test_admit_rules.py', '-k', 'backs_off'], "AE's backoff stops doubling at 8 AR steps, not 16"),
    Mutation('ae-state-in-flight-as-missing', SPEC,
             'return "in_flight" if in_flight and in_flight(key) else "missing"',
             'return "missing"',
             ['tests/test_residency_gating.py'], 'an expert being prefetched priced as a cold miss'),
    Mutation('no-share-kv-ignored', 'runtime/decoding/methods.py',
             '    if share_kv is not None:\n',
             '    if share_kv:\n',
             ['tests/test_speculative.py', '-k', 'share_kv'], '--no-share-kv (share_kv=False) ignored'),
    Mutation('rg-cap-below-k', 'runtime/decoding/gating.py',
             'preferred = top_k_indices(g[None, :], min(max(self.cap, k), E))[0]',
             'preferred = top_k_indices(g[None, :], min(self.cap, E))[0]',
             ['tests/test_residency_gating.py'], "reuse gating's E* smaller than k when the cap is"),
    Mutation('rg-resident-ignores-confidences', 'runtime/decoding/gating.py',
             'if self.variant in ("paper", "resident") and self.confidences is not None:',
             'if self.variant == "paper" and self.confidences is not None:',
             ['tests/test_residency_gating.py'], 'the resident variant weighs tokens by router peakedness, not draft confidence'),
    Mutation('kv-commit-backwards', 'runtime/model/kv_cache.py',
             'if not self.length <= upto <= self.filled:',
             'if not 0 <= upto <= self.filled:',
             ['tests/test_kv_cache.py'], 'a commit below the committed length accepted'),
    Mutation('kv-keep-slot-at-filled', 'runtime/model/kv_cache.py',
             '(slots and max(slots) >= self.filled)',
             '(slots and max(slots) > self.filled)',
             ['tests/test_kv_cache.py'], 'keep() moves a slot that was never written'),
    Mutation('gguf-v2-refused', 'runtime/model/formats/gguf_index.py',
             'if version not in (2, 3):',
             'if version not in (3,):',
             ['tests/test_reliability.py', '-k', 'version_2'], 'GGUF version 2 files refused'),
    Mutation('gguf-header-past-first-mib-unread', 'runtime/model/formats/gguf_index.py',
             '        if self.pos + n > len(self.blob):\n',
             '        if False:\n',
             ['tests/test_reliability.py', '-k', 'first_mib_read'], 'a GGUF header past its first MiB never read'),
    Mutation('export-tpot-rounded-to-2', 'calib/fit_export.py',
             'round(c["t_ar_ms"], 4)',
             'round(c["t_ar_ms"], 2)',
             ['tests/test_calib.py', '-k', 'export'], 'exported T_AR rounded to 2 decimals'),
    Mutation('profile-nan-accepted', 'runtime/schema_check.py',
             'if kind == "number" and isinstance(value, float) and not math.isfinite(value):',
             'if False:',
             ['tests/test_calib.py', '-k', 'non_finite'], "NaN / Infinity accepted in a profile's numbers"),
    Mutation('prefetch-one-slot-too-many', 'runtime/offload/cache.py',
             'if len(self._prefetched) >= self.prefetch_slots:',
             'if len(self._prefetched) > self.prefetch_slots:',
             ['tests/test_draft_residency.py', '-k', 'slots'], 'one prefetch more than its slots'),
    Mutation('available-mask-all-layers', 'runtime/offload/cache.py',
             '                if L == layer:\n',
             '                if True:\n',
             ['tests/test_draft_residency.py', '-k', 'slots'], 'a prefetch marks its expert available in every layer'),
    Mutation('bench-seed-ignored', 'runtime/cli/bench.py',
             'params = SamplingParams(temperature=temperature, seed=seed)',
             'params = SamplingParams(temperature=temperature)',
             ['tests/test_cli.py', '-k', 'sampled_bench'], 's2moe bench --seed ignored'),
    Mutation("lfu-half-life-64", "runtime/offload/cache.py", "def __init__(self, half_life: float = 512.0):",
             "def __init__(self, half_life: float = 64.0):", ["tests/test_cache_policy.py"],
             "the LFU cache's default half-life 64 accesses, not 512"),
    Mutation("estimate-miss-per-batch", "runtime/decoding/estimate.py",
             "t_read = _median_time(lambda: store.read_many(L, experts), 2) / len(experts)",
             "t_read = _median_time(lambda: store.read_many(L, experts), 2)",
             ["tests/test_live_costs.py", "-k", "start_up"], "the start-up estimate prices a miss at a batch of reads"),
    # -- a fourth set: siblings of the issue's own mutations, from a third read-only review --
    Mutation('verify-law-ignores-top-p-min-p', SPEC,
             '            p = probabilities(parent, self.params)\n',
             '            p = probabilities(parent, SamplingParams(self.params.temperature, self.params.top_k))\n',
             ['tests/test_sampled_speculation.py', '-k', 'top_p_and_min_p'], "verification's target law without top-p / min-p: tokens outside the nucleus come out"),
    Mutation('draft-law-ignores-top-p-min-p', SPEC,
             'q = probabilities(logits, self.params)',
             'q = probabilities(logits, SamplingParams(self.params.temperature, self.params.top_k))',
             ['tests/test_sampled_speculation.py', '-k', 'top_p_and_min_p'], 'the draft samples without top-p / min-p (lossless, accepts less)'),
    Mutation('spec-ar-steps-unseeded', SPEC,
             '                done = emit([sample(logits[-1], self.params, rng)])',
             '                done = emit([sample(logits[-1], self.params, np.random.default_rng())])',
             ['tests/test_sampled_speculation.py', '-k', 'generate_ar_draws'], "the decoder's plain AR steps draw from an unseeded generator"),
    Mutation('lfu-heap-entry-at-insert-time', 'runtime/offload/cache.py',
             'count, last = self.count[key], self.last.get(key, 0)',
             'count, last = self.count[key], self.clock',
             ['tests/test_cache_policy.py'], 'LFU dates a kept expert by its insertion, not its last use'),
    Mutation('fingerprint-policy-defaults-to-refuse', 'runtime/cli/spec_options.py',
             'if prof.data["model"].get("fingerprint_policy") == "refuse":',
             'if prof.data["model"].get("fingerprint_policy", "refuse") == "refuse":',
             ['tests/test_reliability.py', '-k', 'without_a_policy'], 'a profile without fingerprint_policy refused for another model, not warned'),
    Mutation('fingerprint-files-in-hash-order', 'runtime/profile.py',
             'files = sorted({r.path for e in loaded.experts.values() for r in e.refs})',
             'files = list({r.path for e in loaded.experts.values() for r in e.refs})',
             ['tests/test_reliability.py', '-k', 'sharded_models_fingerprint'], "a sharded model's fingerprint changes from process to process"),
    Mutation('predict-pins-another-models-hot-list', 'calib/predict.py',
             'hot = prof.hot_experts if prof.data["model"].get("fingerprint") == fingerprint else []',
             'hot = prof.hot_experts',
             ['tests/test_predict.py', '-k', 'lends_no_hot'], "predict pins another model's hot list"),
    Mutation('fit-old-samples-fingerprint-not-recomputed', 'calib/fit_export.py',
             '    if fingerprint is None and isinstance(samples.get("model"), str) and os.path.exists(samples["model"]):',
             '    if False:',
             ['tests/test_calib_inputs.py', '-k', 'older_samples'], 'fit refuses older samples files of the right model'),
    Mutation('safetensors-header-limit-removed', 'runtime/model/formats/safetensors_index.py',
             'if n > _MAX_HEADER or 8 + n > size:',
             'if 8 + n > size:',
             ['tests/test_reliability.py', '-k', 'over_the_limit'], 'the 100 MiB safetensors header limit dropped'),
    Mutation('gguf-array-nesting-unbounded', 'runtime/model/formats/gguf_index.py',
             'if kind == 9 and depth < _MAX_DEPTH:',
             'if kind == 9:',
             ['tests/test_reliability.py', '-k', 'deeply_nested'], 'GGUF arrays nested without a depth limit (RecursionError)'),
    Mutation('gguf-alignment-check-removed', 'runtime/model/formats/gguf_index.py',
             'if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):',
             'if False:',
             ['tests/test_reliability.py', '-k', 'power_of_two'], 'a GGUF alignment of 0 or not a power of two accepted'),
    Mutation('export-hot-list-sorted', 'calib/fit_export.py',
             'write_json_atomic(hot_out, {"gpu_experts": [list(k) for k in hot]})',
             'write_json_atomic(hot_out, {"gpu_experts": [list(k) for k in sorted(hot)]})',
             ['tests/test_calib.py', '-k', 'rank_order'], "export's hot list written sorted, not in rank order"),
    Mutation("json-bomb-unguarded", "runtime/jsonfile.py",
             "    except RecursionError:\n        raise ValueError(TOO_DEEP) from None",
             "    except MemoryError:\n        raise ValueError(TOO_DEEP) from None",
             ["tests/test_json_bombs.py"], "a nested-JSON bomb in a config, profile or hot list: a traceback"),
]


# -- the scratch copy ---------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def make_copy(source: str, dest: str) -> None:
    """``worktree``: tracked and untracked-but-not-ignored files as they are on disk (plus built
    extension modules); anything else: that git revision."""
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
        outcome, took, detail = run_pytest(copy, [] if full else m.tests, timeout)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
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
