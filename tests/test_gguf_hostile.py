"""Hostile GGUF headers get one-line errors and exit 2 (the GGUF rows of docs/reliability.md:
counts past the file, strings past its end, duplicate names and keys, overlapping data), nesting,
alignment and block rows are refused, and the valid layouts a strict parser might refuse still load
(tensor table out of offset order, version 2, a header past the first MiB read). Cases edit a real
converted file byte by byte, located by a small walker written from the GGUF specification.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from s2moe.runtime.errors import S2MoEError
from s2moe.runtime.model.loader import load_model

from helpers import one_line_error, s2moe


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_layout(data: bytes) -> dict:
    """Byte positions in a GGUF v3 file, found by our own walk (independent of the product's
    parser): the first string value, and per tensor its name's length field and its offset field."""
    pos, n_tensors, n_kv = 24, *struct.unpack_from("<QQ", data, 8)
    first_string = None

    def skip(kind):
        nonlocal pos, first_string
        if kind in _SCALAR:
            pos += _SCALAR[kind]
        elif kind == 8:
            if first_string is None:
                first_string = pos
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        else:  # array
            sub, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                skip(sub)

    keys = {}
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        keys[data[pos + 8: pos + 8 + n].decode()] = pos
        pos += 8 + n
        kind = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        skip(kind)
    tensors = {}
    for _ in range(n_tensors):
        at = pos
        n = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8: pos + 8 + n].decode()
        pos += 8 + n
        dims = struct.unpack_from("<I", data, pos)[0]
        pos += 4 + 8 * dims + 4
        tensors[name] = (at, pos)  # name field, offset field
        pos += 8
    return {"first_string": first_string, "tensors": tensors, "keys": keys}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dirs, tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    code, _, stderr = s2moe("convert", "-m", tiny_model_dirs["olmoe"][1], "-o", path, "--type", "F32")
    assert code == 0, stderr
    return path.read_bytes()


def _same_length_pair(names, within: str = "blk") -> tuple[str, str]:
    by_len: dict[int, list[str]] = {}
    for name in names:
        by_len.setdefault(len(name), []).append(name)
    return next(sorted(v)[:2] for v in by_len.values() if len(v) >= 2 and within in v[0])


def _gguf_case(data: bytes, case: str) -> tuple[bytes, str]:
    b = bytearray(data)
    layout = gguf_layout(data)
    tensors = layout["tensors"]
    if case == "10^12 tensors":  # row: GGUF header claiming 10¹² tensors
        b[8:16] = struct.pack("<Q", 10**12)
        return bytes(b), "cannot fit"
    if case == "10^12 metadata entries":
        b[16:24] = struct.pack("<Q", 10**12)
        return bytes(b), "cannot fit"
    if case == "string length":  # row: a string length mutated: the pre-scan refuses it
        b[layout["first_string"]:layout["first_string"] + 8] = struct.pack("<Q", 10**12)
        return bytes(b), "runs past the end of the file"
    if case == "duplicate metadata key":  # row: duplicates refused
        first, second = _same_length_pair(layout["keys"], within="")
        at = layout["keys"][second]
        b[at + 8: at + 8 + len(first)] = first.encode()
        return bytes(b), f"metadata key {first} appears twice"
    first, second = _same_length_pair(tensors)
    if case == "duplicate tensor":  # row: duplicates refused
        at = tensors[second][0]
        b[at + 8: at + 8 + len(first)] = first.encode()
        return bytes(b), first  # and "appears twice" (ours) or "duplicated" (gguf's GGUFReader)
    if case == "overlapping tensors":  # row: overlapping tensors refused
        src, dst = tensors[first][1], tensors[second][1]
        b[dst:dst + 8] = b[src:src + 8]
        return bytes(b), "overlap"
    # tensors by their data offset (relative to the data section), with the room up to the next one
    rel = {name: struct.unpack_from("<Q", data, at)[0] for name, (_, at) in tensors.items()}
    order = sorted(rel, key=rel.get)
    room = {a: rel[b] - rel[a] for a, b in zip(order, order[1:])}
    if case == "partly overlapping tensors":  # not at the same offset: B starts 32 bytes into A
        big = max(room, key=room.get)
        small = next(n for n in order[:-1] if n != big and room[n] <= room[big] - 32)
        b[tensors[small][1]:tensors[small][1] + 8] = struct.pack("<Q", rel[big] + 32)
        return bytes(b), "overlap"
    if case == "tensor past the end by less than the header":
        # the last tensor moved 64 bytes on: its end passes the file's end (padding < 32), though its
        # offset within the data section plus its size does not (the header is far over 64 bytes)
        last = order[-1]
        b[tensors[last][1]:tensors[last][1] + 8] = struct.pack("<Q", rel[last] + 64)
        return bytes(b), "truncated GGUF file"
    raise ValueError(case)


GGUF_CASES = ["10^12 tensors", "10^12 metadata entries", "string length", "duplicate tensor", "duplicate metadata key",
              "overlapping tensors", "partly overlapping tensors", "tensor past the end by less than the header"]


@pytest.mark.parametrize("case", GGUF_CASES)
def test_hostile_gguf_header_is_one_line_exit_2(tiny_gguf, tmp_path, case):
    data, needle = _gguf_case(tiny_gguf, case)
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    code, _, stderr = s2moe("info", "--model", path)
    one_line_error(code, stderr, needle, "bad.gguf")
    if case == "duplicate tensor":
        assert "appears twice" in stderr or "duplicated" in stderr, stderr


def test_the_unmodified_gguf_loads(tiny_gguf, tmp_path):
    """The cases above fail because of their one edit: the file they start from is fine."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(tiny_gguf)
    code, stdout, stderr = s2moe("info", "--model", path, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["architecture"] == "olmoe"


def test_a_gguf_whose_tensor_table_is_not_in_offset_order_loads(tiny_gguf, tmp_path):
    """GGUF does not require the tensor table in offset order: two neighbours of the same size with
    their offsets swapped are a valid file (their weights trade places), not an overlap."""
    from gguf import GGUFReader

    src = tmp_path / "src.gguf"
    src.write_bytes(tiny_gguf)
    table = [(t.name, int(t.n_bytes)) for t in GGUFReader(str(src)).tensors]
    a, b = next((x[0], y[0]) for x, y in zip(table, table[1:]) if x[1] == y[1])
    fields = gguf_layout(tiny_gguf)["tensors"]
    data = bytearray(tiny_gguf)
    (oa, ob) = fields[a][1], fields[b][1]
    data[oa:oa + 8], data[ob:ob + 8] = tiny_gguf[ob:ob + 8], tiny_gguf[oa:oa + 8]
    path = tmp_path / "swapped.gguf"
    path.write_bytes(bytes(data))
    assert load_model(str(path)).experts  # parsed: no overlap reported
    code, stdout, stderr = s2moe("info", "--model", path, "--json")
    assert code == 0, stderr


def test_a_version_2_gguf_loads(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf)
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 share this layout (64-bit counts and lengths)
    path = tmp_path / "v2.gguf"
    path.write_bytes(bytes(data))
    assert load_model(str(path)).experts


def test_a_gguf_header_larger_than_the_first_mib_read_is_parsed_whole(tmp_path):
    """The header is read 1 MiB at first and grown on demand: a 128k-token vocabulary makes
    headers of several MiB."""
    import gguf

    from s2moe.runtime.model.formats.gguf_index import GGUFIndex

    path = tmp_path / "big-header.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_string("general.description", "x" * (3 << 20))  # 3 MiB of metadata before the tensor table
    w.add_tensor("blk.0.t.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    idx = GGUFIndex(str(path))
    assert len(idx.metadata["general.description"]) == 3 << 20 and set(idx.tensors) == {"blk.0.t.weight"}


def test_deeply_nested_gguf_arrays_are_refused_not_recursed(tmp_path):
    from s2moe.runtime.model.formats.gguf_index import GGUFIndex

    body = struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)  # one key, "a": an array ...
    body += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)  # ... of arrays, 5,000 deep
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    with pytest.raises(S2MoEError):
        GGUFIndex(str(path))


@pytest.mark.parametrize("alignment", [0, 48])
def test_a_gguf_alignment_that_is_not_a_power_of_two_is_one_line(tiny_gguf, tmp_path, alignment):
    data = bytearray(tiny_gguf)
    at = gguf_layout(tiny_gguf)["keys"]["general.alignment"] + 8 + len("general.alignment")
    assert struct.unpack_from("<I", data, at)[0] == 4  # a uint32 value follows
    data[at + 4:at + 8] = struct.pack("<I", alignment)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    code, _, stderr = s2moe("info", "--model", path)
    one_line_error(code, stderr, "general.alignment", "not a power of two", "bad.gguf")


def test_a_quantized_tensor_whose_rows_do_not_fill_blocks_is_refused(tmp_path):
    """Q8_0 packs 32 values a block, row by row. A 64 × 24 tensor loads; the same 1,536 values
    relabelled 48 × 32 fill 48 blocks in all, but no row fills whole blocks: refused."""
    import gguf

    from s2moe.runtime.model.formats.gguf_index import GGUFIndex

    path = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_tensor("blk.0.q.weight", np.zeros((24, 68), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at, _ = gguf_layout(bytes(data))["tensors"]["blk.0.q.weight"]
    dims = at + 8 + len("blk.0.q.weight") + 4  # name (u64 length + bytes), n_dims (u32), then the dims
    assert struct.unpack_from("<QQ", data, dims) == (64, 24)
    assert GGUFIndex(str(path)).tensors["blk.0.q.weight"]
    struct.pack_into("<QQ", data, dims, 48, 32)
    path.write_bytes(bytes(data))
    with pytest.raises(S2MoEError, match=r"blk\.0\.q\.weight: rows of 48 values do not fill Q8_0 blocks of 32"):
        GGUFIndex(str(path))
