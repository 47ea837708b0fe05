"""Hostile model files: ≥ 10,000 mutated GGUF and safetensors headers each, zero crashes other than
the project's own errors, and bounded memory while parsing them."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s2moe.runtime.errors import S2MoEError
from s2moe.runtime.model.formats.gguf_index import GGUFIndex
from s2moe.runtime.model.formats.safetensors_index import read_header

N_MUTATIONS = 10_000
MEMORY_CAP = 64 << 20  # bytes of Python allocations while parsing one file


def _small_safetensors(path) -> bytes:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({f"t{i}": rng.normal(size=(3, 4)).astype(np.float16) for i in range(6)}, str(path))
    return path.read_bytes()


def _small_gguf(path) -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_token_list(["a", "b", "c"])
    for i in range(4):
        w.add_tensor(f"blk.0.t{i}.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _mutate(data: bytes, header_end: int, rng) -> bytes:
    """One random edit concentrated on the header, where parsers make their decisions."""
    b = bytearray(data)
    kind = rng.integers(0, 6)
    pos = int(rng.integers(0, max(header_end, 1)))
    if kind == 0:  # flip a few bytes
        for _ in range(int(rng.integers(1, 9))):
            b[int(rng.integers(0, header_end))] = int(rng.integers(0, 256))
    elif kind == 1:  # truncate anywhere
        del b[int(rng.integers(0, len(b))):]
    elif kind == 2:  # insert junk
        b[pos:pos] = bytes(rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8))
    elif kind == 3:  # delete a run
        del b[pos:pos + int(rng.integers(1, 16))]
    elif kind == 4:  # an extreme 64-bit count or length at an aligned header position
        at = int(rng.integers(0, max(header_end // 8, 1))) * 8
        b[at:at + 8] = struct.pack("<Q", int(rng.choice([2**63 - 1, 10**12, 2**32, 0, 1])))
    else:  # an extreme 32-bit field
        at = int(rng.integers(0, max(header_end // 4, 1))) * 4
        b[at:at + 4] = struct.pack("<I", int(rng.choice([2**32 - 1, 2**31, 0, 0xFFFF])))
    return bytes(b)


def _run(parse, path, data: bytes) -> str:
    path.write_bytes(data)
    tracemalloc.start()
    try:
        parse(str(path))
        outcome = "ok"
    except S2MoEError:
        outcome = "error"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < MEMORY_CAP, f"parsing used {peak} bytes"
    return outcome


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_mutated_headers_never_crash(tmp_path, fmt):
    if fmt == "safetensors":
        data = _small_safetensors(tmp_path / "seed.safetensors")
        header_end = 8 + struct.unpack("<Q", data[:8])[0]
        parse = read_header
    else:
        data = _small_gguf(tmp_path / "seed.gguf")
        header_end = min(len(data), GGUFIndex(str(tmp_path / "seed.gguf")).reader.data_offset)
        parse = GGUFIndex
    rng = np.random.default_rng(20261129)
    target = tmp_path / f"case.{fmt}"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(N_MUTATIONS):
        outcomes[_run(parse, target, _mutate(data, header_end, rng))] += 1
    assert sum(outcomes.values()) == N_MUTATIONS
    assert outcomes["error"] > N_MUTATIONS // 4  # the mutations really break things


def test_absurd_tensor_count_is_refused_at_once(tmp_path):
    data = bytearray(_small_gguf(tmp_path / "seed.gguf"))
    data[8:16] = struct.pack("<Q", 10**12)
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(S2MoEError, match="cannot fit"):
        GGUFIndex(str(tmp_path / "bad.gguf"))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(entries=st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(
        st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "BF16", "Q9", 3]),
                               "shape": st.lists(st.one_of(st.integers(-3, 10**13), st.floats(), st.booleans()),
                                                 max_size=4),
                               "data_offsets": st.lists(st.integers(-5, 10**15), min_size=0, max_size=3)}),
        st.integers(), st.text(), st.none(), st.lists(st.integers())),
    max_size=5))
def test_structured_safetensors_headers(tmp_path_factory, entries):
    """Well-formed JSON with hostile values: shapes, offsets, types, overlaps."""
    header = json.dumps(entries).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(64)
    path = tmp_path_factory.mktemp("st") / "h.safetensors"
    _run(read_header, path, blob)
