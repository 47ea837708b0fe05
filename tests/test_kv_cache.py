import numpy as np
import pytest

from s2moe.runtime.errors import KVCacheError
from s2moe.runtime.model.kv_cache import KVCache


def make():
    return KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=8)


def test_draft_writes_stay_uncommitted_and_rollback_is_exact():
    kv = make()
    kv.begin_write(0, 4)
    kv.commit(4)
    kv.begin_write(4, 3)  # draft
    assert (kv.length, kv.filled) == (4, 7)
    assert kv.rollback(kv.length) == 3
    assert (kv.length, kv.filled) == (4, 4)
    assert kv.trim(2) == 2 and (kv.length, kv.filled) == (2, 2)
    assert kv.trim(0) == 0 and kv.trim(2) == 2 and (kv.length, kv.filled) == (0, 0)  # the bounds: none, all


def test_trim_counts_back_from_the_valid_end_drafts_included():
    kv = make()
    kv.begin_write(0, 4)
    kv.commit(4)
    kv.begin_write(4, 3)  # 4 committed, 3 drafted: the last valid position is 6
    assert kv.trim(2) == 2 and (kv.length, kv.filled) == (4, 5)  # two draft positions gone, one kept
    assert kv.trim(3) == 3 and (kv.length, kv.filled) == (2, 2)  # the draft, then two committed


@pytest.mark.parametrize("bad", [-1, 5])
def test_invalid_rollback_raises(bad):
    kv = make()
    kv.begin_write(0, 4)
    with pytest.raises(KVCacheError):
        kv.rollback(bad)
    with pytest.raises(KVCacheError):
        kv.trim(5)


def test_gap_overflow_and_bad_commit_raise():
    kv = make()
    kv.begin_write(0, 2)
    with pytest.raises(KVCacheError, match="gap"):
        kv.begin_write(3, 1)
    with pytest.raises(KVCacheError, match="full"):
        kv.begin_write(2, 7)
    with pytest.raises(KVCacheError):
        kv.commit(3)


def test_rewrite_inside_committed_region_uncommits_the_tail():
    kv = make()
    kv.begin_write(0, 6)
    kv.commit(6)
    kv.begin_write(3, 1)  # recomputing position 3 invalidates 4, 5
    assert (kv.length, kv.filled) == (3, 4)


def test_write_and_view_round_trip():
    kv = make()
    kv.begin_write(0, 3)
    k = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    kv.write(1, 0, k, -k)
    keys, values = kv.view(1, 3)
    assert np.array_equal(keys, k) and np.array_equal(values, -k)


def test_keep_moves_an_accepted_branch_into_place():
    """A verified tree [root, a1, a2, b1, b2] at positions P.. with branch b accepted: keep moves
    the KV of slots [P, P+3, P+4] to [P, P+1, P+2] and drops the rest."""
    kv = make()
    kv.begin_write(0, 8)
    for layer in range(2):
        kv.write(layer, 0, np.arange(8, dtype=np.float32).reshape(1, 8, 1).repeat(2, -1) + 10 * layer,
                 -np.arange(8, dtype=np.float32).reshape(1, 8, 1).repeat(2, -1))
    kv.commit(3)  # P = 3: slots 3..7 hold [root, a1, a2, b1, b2]
    kv.keep([3, 6, 7], 3)
    assert (kv.length, kv.filled) == (3, 6)
    for layer in range(2):
        keys, values = kv.view(layer, 6)
        np.testing.assert_array_equal(keys[0, :, 0], [0, 1, 2, 3, 6, 7] + np.float32(10 * layer))
        np.testing.assert_array_equal(values[0, :, 0], -np.array([0, 1, 2, 3, 6, 7], dtype=np.float32))
    with pytest.raises(KVCacheError):
        kv.keep([4, 3], 3)  # a slot may only move backwards


def test_commit_never_moves_backwards_and_keep_takes_only_written_slots():
    kv = make()
    kv.begin_write(0, 4)
    kv.commit(4)
    with pytest.raises(KVCacheError):
        kv.commit(2)  # committed KV is final; rolling back is rollback()'s job
    assert (kv.length, kv.filled) == (4, 4)
    kv.begin_write(4, 2)  # slots 4, 5 written; slot 6 never was
    with pytest.raises(KVCacheError):
        kv.keep([5, 6], 4)
