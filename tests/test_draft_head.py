"""FR-Spec draft heads (`--draft-vocab N`, model/draft_head.py): the draft's lm head covers the N most
frequent tokens, verification keeps the full head.

Pinned down: the head's logits are the full head's on its tokens (C kernels and the NumPy path),
−inf elsewhere; greedy output of every lossless method equals AR's while the target emits tokens the
head cannot propose; sampled verification keeps the target's law exactly when the draft's law has
no mass outside the head (both samplers, chi-square as in test_sampled_speculation); on the host the
head is a view of the full head's rows, stored in rank order in place (the target's logits and a tied
embedding unchanged), so the memory plan holds nothing for it, and copies elsewhere are planned; bad ranks files end in one line; `s2moe vocab` counts and ranks.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import one_line_error, s2moe
from stub_model import START, StubModel, exact_law, table_draft, table_target
from test_sampled_speculation import ALPHA, EAGER, chi_square_pvalue, truncated

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.decoding.methods import SpecSettings, get_method
from s2moe.runtime.decoding.sampling import SamplingParams
from s2moe.runtime.decoding.speculative import SpeculativeDecoder
from s2moe.runtime.engine import build_engine, draft_head_bytes
from s2moe.runtime.model.draft_head import (DraftHead, RANKS_FILE, count_tokens, load_token_ranks, permute_rows,
                                            ranks_document, write_ranks)
from s2moe.runtime.model.routing import RoutingPolicy
from s2moe.runtime.kernels.stored import DeviceStored, StoredMatrix

LOSSLESS = ["ca", "ca+ae", "s2moe", "es", "confidence", "cascade"]
PROMPT = [15, 64, 13, 266, 280, 9, 1200, 77]


def _ranks_for(folder, vocab: int, seed: int = 0) -> None:
    """A ranks file in ``folder`` ranking every token (a random order: the head is any subset)."""
    counts = np.random.default_rng(seed).permutation(vocab) + 1
    write_ranks(os.path.join(folder, RANKS_FILE), ranks_document(counts, "test"))


@pytest.mark.parametrize("kernels", ["cpu", "numpy"])
def test_draft_head_logits_are_the_full_heads_on_its_tokens(kernels):
    engine = build_engine(str(DEFAULT_MODEL), kernels=kernels)
    m = engine.model
    policy = RoutingPolicy(top_k=2)
    before = m.forward(PROMPT, m.new_cache(32), policy=policy, logits="all")[0]  # rows in token order
    head = m.draft_head(1000)
    ranks = load_token_ranks(str(DEFAULT_MODEL / RANKS_FILE), m.config.vocab_size)
    assert np.array_equal(head.ids, ranks[:1000])  # the 1000 most frequent, in the rows' (rank) order
    # no bytes of its own: the full head's first rows, which are now stored in rank order
    assert np.shares_memory(head.weight.data, m.W["lm_head"].data)
    outs = []
    for h in (None, head):
        kv = m.new_cache(32)
        outs.append(m.forward(PROMPT, kv, policy=policy, logits="all", head=h)[0])
    full, sub = outs
    # the target's logits come back in token order: the permutation changes nothing it computes
    np.testing.assert_allclose(full, before, rtol=0, atol=0 if kernels == "cpu" else 1e-5)
    inside = np.zeros(m.config.vocab_size, bool)
    inside[head.ids] = True
    assert np.all(np.isneginf(sub[:, ~inside]))
    # the same rows times the same activations: the C kernel computes each row alone (exact); the
    # NumPy path decodes in chunks of other sizes, so BLAS may sum in another order (float32 rounding)
    np.testing.assert_allclose(sub[:, inside], full[:, inside], rtol=0, atol=0 if kernels == "cpu" else 1e-5)


def test_rows_are_permuted_in_place_as_a_copy_would_order_them():
    rng = np.random.default_rng(3)
    W = StoredMatrix.from_float(rng.standard_normal((50, 64)).astype(np.float32), "Q8_0")
    order = rng.permutation(50)
    order[:5] = [0, 2, 1, 3, 4]  # fixed points and a 2-cycle beside the long cycles
    order = np.concatenate([order[:5], rng.permutation(np.setdiff1d(np.arange(50), order[:5]))])
    want = W.rows(order).dequantize()
    buffer = W.data
    got = permute_rows(W, order)
    assert got is W and got.data is buffer  # no second head in memory
    np.testing.assert_array_equal(got.dequantize(), want)
    frozen = StoredMatrix.from_float(rng.standard_normal((50, 64)).astype(np.float32), "F16")
    frozen.data.flags.writeable = False  # a read-only buffer is copied, never written
    np.testing.assert_array_equal(permute_rows(frozen, order).dequantize(), frozen.dequantize()[order])


def test_a_tied_embedding_is_looked_up_through_the_rank_order():
    """A tied head is the embedding's matrix: permuting its rows must not move what a token embeds
    to. (The default model's head stands in for a tied embedding here.)"""
    engine = build_engine(str(DEFAULT_MODEL))
    m = engine.model
    m.W["embed"] = m.W["lm_head"]
    before = m.forward(PROMPT, m.new_cache(32), logits="all")[0]
    head = m.draft_head(1000)
    assert m.W["embed"] is m.W["lm_head"] and np.shares_memory(head.weight.data, m.W["embed"].data)
    np.testing.assert_array_equal(m.forward(PROMPT, m.new_cache(32), logits="all")[0], before)


def test_models_on_one_loaded_model_share_the_rows_order():
    """`bench` builds an engine per method on one loaded model: the weights, and so the order of
    the head's rows, are theirs together. A head built by one model must neither scramble another's
    logits nor be permuted a second time by it."""
    first = build_engine(str(DEFAULT_MODEL), "0.25")
    second = build_engine(str(DEFAULT_MODEL), "0.25", loaded=first.loaded)
    assert second.model.W is first.model.W
    before = second.model.forward(PROMPT, second.model.new_cache(32), logits="all")[0]
    head = first.model.draft_head(1000)
    np.testing.assert_array_equal(second.model.forward(PROMPT, second.model.new_cache(32), logits="all")[0], before)
    again = second.model.draft_head(1000)
    assert np.array_equal(again.ids, head.ids) and np.shares_memory(again.weight.data, head.weight.data)
    sub = second.model.forward(PROMPT, second.model.new_cache(32), logits="all", head=again)[0]
    np.testing.assert_array_equal(sub[:, again.ids], before[:, again.ids])


def test_a_second_ranking_gets_a_copy_of_its_rows(tmp_path):
    """The rows can be stored in one order only: a head from another ranks file copies its rows."""
    engine = build_engine(str(DEFAULT_MODEL))
    m = engine.model
    V = m.config.vocab_size
    first = m.draft_head(1000)
    other = tmp_path / "ranks.json"
    write_ranks(str(other), ranks_document(np.random.default_rng(5).permutation(V) + 1, "test"))
    second = m.draft_head(500, str(other))
    assert not np.shares_memory(second.weight.data, m.W["lm_head"].data)
    assert np.shares_memory(first.weight.data, m.W["lm_head"].data)
    full = m.forward(PROMPT, m.new_cache(32), logits="all")[0]
    sub = m.forward(PROMPT, m.new_cache(32), logits="all", head=second)[0]
    np.testing.assert_array_equal(sub[:, second.ids], full[:, second.ids])


def test_head_rows_of_a_device_matrix_are_the_hosts():
    W = StoredMatrix.from_float(np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32), "Q8_0")
    ids = np.array([3, 7, 8, 31, 39])
    on_device = DeviceStored(W.data, W.dtype, W.shape, np).rows(ids)
    assert on_device.shape == (5, 64)
    np.testing.assert_array_equal(on_device.dequantize(), W.rows(ids).dequantize())
    np.testing.assert_array_equal(on_device.dequantize(), W.dequantize()[ids])


@pytest.mark.parametrize("budget", [None, "0.25"])
def test_greedy_methods_equal_ar_with_a_draft_vocab(tiny_model_dirs, budget):
    folder = tiny_model_dirs["olmoe"][1]
    engine = build_engine(folder, budget)
    V = engine.model.config.vocab_size
    _ranks_for(folder, V)
    n = V // 4  # a quarter of the tokens: the target often emits one the draft cannot propose
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, 380, rng.integers(3, 12))) for _ in range(8)]
    expected = [generate_ar(engine.model, p, 16).tokens for p in prompts]
    head_ids = set(engine.model.draft_head(n).ids.tolist())
    outside = sum(t not in head_ids for toks in expected for t in toks[1:])
    assert outside >= 10, outside  # the comparison exercises tokens outside the head
    from test_speculative import EAGER as EAGER_TINY

    for name in LOSSLESS:
        dec = SpeculativeDecoder(engine.model, get_method(name, reuse_gating=False),
                                 SpecSettings(draft_topk=1, draft_cap=5, confidence_threshold=0.004, draft_vocab=n),
                                 EAGER_TINY)
        drafted, accept = [], dec._accept_chain

        def spy(logits, d, *rest, _accept=accept):
            drafted.extend(d.tokens)
            return _accept(logits, d, *rest)

        dec._accept_chain = spy
        got = [dec.generate(p, 16).tokens for p in prompts]
        assert got == expected, name
        assert drafted and set(drafted) <= head_ids, name  # it drafted, and only the head's tokens
        assert dec.metrics.vocab_tokens > 0 and dec.metrics.draft_vocab == n


class _HeadStub(StubModel):
    """The stub with a draft head over tokens {0, 1}: token 2 reaches the text only through
    verification (a rejection's residual or the bonus token)."""

    def draft_head(self, n, ranks_path=None):
        return DraftHead(np.arange(n, dtype=np.int64), None, self.config.vocab_size)


def test_ar_builds_no_draft_head():
    """AR drafts nothing, and its memory plan (engine.py) leaves no room for a head: `bench` runs AR
    with the settings of the drafting methods, so the decoder must not build one."""
    model = _HeadStub(table_target, table_draft, vocab=4)
    settings = SpecSettings(draft_topk=1, draft_cap=2, draft_vocab=2)
    assert SpeculativeDecoder(model, get_method("ar"), settings, EAGER).draft_head is None
    assert SpeculativeDecoder(model, get_method("ca"), settings, EAGER).draft_head.size == 2


@pytest.mark.parametrize("sampler", ["standard", "coupled"])
def test_a_draft_head_keeps_the_target_law(sampler):
    model = _HeadStub(table_target, table_draft, vocab=4)
    counts: dict[tuple, int] = {}
    drafted: list[int] = []
    accepted = total = 0
    for seed in range(500):  # ca, draft of 2, 4 tokens compared: as test_sampled_speculation's ca-L2
        dec = SpeculativeDecoder(model, get_method("ca"), SpecSettings(draft_topk=1, draft_cap=2, draft_vocab=2),
                                 EAGER, SamplingParams(temperature=1.0, seed=seed, sampler=sampler))
        accept = dec._accept_chain

        def spy(logits, d, *rest, _accept=accept):
            drafted.extend(d.tokens)
            return _accept(logits, d, *rest)

        dec._accept_chain = spy
        out = tuple(dec.generate([START], 4).tokens)
        counts[out] = counts.get(out, 0) + 1
        accepted, total = accepted + dec.metrics.accepted, total + dec.metrics.drafted
    assert set(drafted) == {0, 1}  # never token 2: the draft's law has no mass outside its head
    assert accepted >= 100 and total - accepted >= 100, (total, accepted)
    law = exact_law(truncated(table_target, SamplingParams(temperature=1.0)), (START,), 4)
    assert any(2 in k for k in counts)  # the text still holds the token the draft cannot propose
    assert not {k for k in counts if k not in law}
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > ALPHA, f"the generated tokens do not follow the target law (p = {pvalue:.2e})"


def test_the_memory_plan_counts_the_draft_heads_rows():
    """On the host the head is a view (nothing to plan); where it is a copy (a device), the plan
    holds its rows."""
    plain = build_engine(str(DEFAULT_MODEL), "0.25")
    with_head = build_engine(str(DEFAULT_MODEL), "0.25", draft_vocab=1536)
    head = plain.loaded.dense_specs["lm_head"]
    stored = head.refs[0].nbytes  # F16: 6144 rows × 256 × 2 bytes
    assert stored == 6144 * 256 * 2
    assert with_head.plan.dense_bytes == plain.plan.dense_bytes
    assert with_head.plan.expert_capacity == plain.plan.expert_capacity
    rows = with_head.model.draft_head(1536).weight
    assert rows.nbytes == stored // 4 and np.shares_memory(rows.data, with_head.model.W["lm_head"].data)
    assert draft_head_bytes(plain.loaded, 1536, on_device=True) == stored // 4


def _ranks_file(tmp_path, **fields):
    doc = {"format": "s2moe-token-ranks", "version": 1, "vocab_size": 6144, "ranked_ids": list(range(100))}
    doc.update(fields)
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("fields,needle", [
    ({"format": "other"}, "field 'format'"),
    ({"vocab_size": 50000}, "field 'vocab_size'"),
    ({"ranked_ids": [1, 2, "x"]}, "field 'ranked_ids'"),
    ({"ranked_ids": [1, 6144]}, "outside 0..6143"),
    ({"ranked_ids": [1, 2, 1]}, "repeats"),
    ({"ranked_ids": list(range(10))}, "ranks only 10 tokens"),
])
def test_bad_ranks_files_end_in_one_line(tmp_path, fields, needle):
    path = _ranks_file(tmp_path, **fields)
    code, _, err = s2moe("run", "--prompt", "x", "--draft-vocab", "50", "--token-ranks", path, "-n", "2")
    one_line_error(code, err, str(path), needle)


def test_missing_or_broken_ranks_files_name_the_fix(tmp_path):
    code, _, err = s2moe("run", "--prompt", "x", "--draft-vocab", "50", "--token-ranks", tmp_path / "none.json")
    one_line_error(code, err, "none.json", "s2moe vocab")
    broken = tmp_path / "broken.json"
    broken.write_text("[" * 100000)
    code, _, err = s2moe("run", "--prompt", "x", "--draft-vocab", "50", "--token-ranks", broken)
    one_line_error(code, err, "broken.json", "s2moe vocab")
    code, _, err = s2moe("run", "--prompt", "x", "--draft-vocab", "7000")
    one_line_error(code, err, "--draft-vocab 7000", "1..6144")


def test_run_reports_the_heads_coverage():
    code, out, _ = s2moe("run", "--prompt", "def add(a, b):", "-t", "0", "-n", "24", "--method", "ca",
                         "--draft-vocab", "300", "--json")
    assert code == 0
    got = json.loads(out)
    ids = load_token_ranks(str(DEFAULT_MODEL / RANKS_FILE), 6144)[:300]
    inside = float(np.isin(got["tokens"], ids).mean())
    assert got["stats"]["draft_vocab"] == {"size": 300, "coverage": round(inside, 4)}
    assert 0 < inside < 1  # a 300-token head misses some of what the model writes


def test_vocab_counts_ranks_and_writes_atomically(tmp_path):
    from s2moe.runtime.model.loader import load_model
    from s2moe.runtime.model.tokenizer import load_tokenizer

    text = "def add(a, b):\n    return a + b\n\n" * 3 + "print(add(1, 2))\n"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    out = tmp_path / "ranks.json"
    code, stdout, _ = s2moe("vocab", "--corpus", corpus, "--out", out, "--json")
    assert code == 0, stdout
    doc = json.loads(out.read_text())
    ids = load_tokenizer(load_model(str(DEFAULT_MODEL), dense=False)).encode(text).ids
    hand = {}
    for i in ids:
        hand[i] = hand.get(i, 0) + 1
    assert dict(zip(doc["ranked_ids"], doc["counts"])) == hand
    assert doc["counts"] == sorted(doc["counts"], reverse=True) and doc["tokens_counted"] == len(ids)
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o666 & ~_umask())
    assert json.loads(stdout)["tokens_seen"] == len(hand)
    assert [f for f in os.listdir(tmp_path) if f.startswith(".s2moe-")] == []  # no temporary left
    code, _, err = s2moe("vocab", "--corpus", corpus, "--out", out)  # exists: needs --force
    one_line_error(code, err, "exists", "--force")
    code, _, err = s2moe("vocab", "--corpus", tmp_path / "nope.txt", "--out", tmp_path / "x.json")
    one_line_error(code, err, "nope.txt", "not found")
    assert not (tmp_path / "x.json").exists()


def test_count_tokens_by_hand():
    counts = count_tokens(lambda t: [int(c) for c in t], ["0120", "22", "9"], 5)  # 9: outside, ignored
    assert counts.tolist() == [2, 1, 3, 0, 0]
    doc = ranks_document(counts, "hand")
    assert doc["ranked_ids"] == [2, 0, 1] and doc["counts"] == [3, 2, 1]  # unseen tokens are not ranked


def test_the_shipped_ranks_file_is_the_embedded_models():
    ranks = load_token_ranks(str(DEFAULT_MODEL / RANKS_FILE), 6144)
    assert ranks.size > 5000  # counted on 3.1 M training tokens: nearly every token was seen


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
