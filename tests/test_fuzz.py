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
        header_end = min(len(data), GGUFIndex(str(tmp_path / "seed.gguf")).data_offset)
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


# -- structured safetensors headers with a reference verdict ---------------------------------------
# The safetensors rules, written here from the format's specification (not from the parser): an entry
# is {dtype: known string, shape: list of ints ≥ 0, data_offsets: [begin, end] ints}, end − begin is
# the shape's byte size, the data lies inside the file and no two tensors overlap. The reference
# returns the text the parser's error must contain, or None when the header is valid.
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U8": 1}
DATA = 64  # bytes of tensor data after the header


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def reference_verdict(entries: dict) -> str | None:
    spans = []
    for name, info in entries.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            return "malformed header entry"
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2 \
                or not all(_is_int(v) for v in (*shape, *offsets)):
            return "malformed header entry"
        if not isinstance(info["dtype"], str):
            return "dtype must be a string"
        if info["dtype"] not in ITEMSIZE:
            return "unsupported dtype"
        if any(d < 0 for d in shape):
            return "negative dimension"
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != int(np.prod(shape, dtype=object)) * ITEMSIZE[info["dtype"]]:
            return "do not hold shape"
        if end > DATA:
            return "truncated"
        spans.append((begin, end))
    spans.sort()
    if any(b1 < e0 for (_, e0), (b1, _) in zip(spans, spans[1:])):
        return "overlap"
    return None


@st.composite
def near_valid_entry(draw):
    """Mostly well-formed tensors in a 64-byte data area (so overlaps and truncation are common),
    one field now and then made hostile."""
    dtype = draw(st.sampled_from(["F32", "F16", "BF16", "U8"] * 6 + ["Q9", "f32", 3, None]))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
    if draw(st.integers(0, 29)) == 0:
        shape = shape + [draw(st.sampled_from([-1, 2.0, True, "2", 10**13]))]
    size = int(np.prod([d for d in shape if _is_int(d)] or [1])) * ITEMSIZE.get(dtype, 4) if isinstance(dtype, str) else 4
    begin = draw(st.sampled_from(range(0, 61, 3)))
    end = begin + size + draw(st.sampled_from([0] * 20 + [1, -1, 64]))
    offsets = draw(st.sampled_from([[begin, end]] * 25 + [[end + 1, begin], [begin], [begin, end, 0], [float(begin), end],
                                                          [-8, end]]))
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    if draw(st.integers(0, 49)) == 0:
        entry.pop(draw(st.sampled_from(sorted(entry))))
    return entry


hostile_value = st.one_of(st.integers(), st.text(max_size=4), st.none(), st.lists(st.integers(), max_size=3),
                          st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "Q9", 3]),
                                                 "shape": st.lists(st.one_of(st.integers(-3, 10**13), st.floats(),
                                                                             st.booleans()), max_size=4),
                                                 "data_offsets": st.lists(st.integers(-5, 10**15), max_size=3)}))


entry = st.integers(0, 19).flatmap(lambda i: hostile_value if i == 0 else near_valid_entry())
VERDICTS = [None, "overlap", "truncated", "do not hold shape", "unsupported dtype", "malformed header entry",
            "negative dimension", "dtype must be a string"]


def test_structured_safetensors_headers(tmp_path):
    """Well-formed JSON with hostile values (300 headers): the parser's verdict (accept, or the
    error naming the problem and the file) equals the specification's, parsing stays small, and
    every verdict occurs among the examples (valid headers and overlaps included)."""
    path = tmp_path / "h.safetensors"
    seen: dict = {}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(entries=st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3),
                                   entry, max_size=4))
    def prop(entries):
        header = json.dumps(entries).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(DATA))
        expected = reference_verdict(entries)
        seen[expected] = seen.get(expected, 0) + 1
        tracemalloc.start()
        try:
            refs = read_header(str(path))
            got = None
        except S2MoEError as exc:
            got, refs = str(exc), None
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < MEMORY_CAP
        if expected is None:
            assert got is None, got
            assert set(refs) == set(entries)
            for name, ref in refs.items():
                begin, end = entries[name]["data_offsets"]
                assert (ref.offset, ref.nbytes, ref.dtype) == (8 + len(header) + begin, end - begin,
                                                               entries[name]["dtype"])
        else:
            assert got is not None, f"accepted a header the format refuses ({expected})"
            assert expected in got and str(path) in got, (expected, got)

    prop()
    assert all(seen.get(v, 0) >= 3 for v in VERDICTS), seen
