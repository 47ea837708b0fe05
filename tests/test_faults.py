"""Fault injection: failing expert reads, a model file changed under us, a full disk on writes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from s2moe.runtime.engine import build_engine
from s2moe.runtime.errors import ExpertReadError
from s2moe.runtime.decoding.generate import generate_ar
from s2moe.runtime.profile import write_json_atomic


@pytest.fixture
def model_copy(tiny_model_dirs, tmp_path):
    return str(shutil.copytree(tiny_model_dirs["olmoe"][1], tmp_path / "m"))


def _engine(folder, mode):
    """``mode``: "native" (O_DIRECT on the extension's I/O threads, the default where built),
    "python" (O_DIRECT on Python threads) or "buffered"."""
    engine = build_engine(folder, "0.25", 64, direct_io=mode != "buffered")
    if mode == "python":
        engine.cache.store.native = False
    store = engine.cache.store
    key = next(iter(store.refs))
    assert (store.native and store.direct(*key)) == (mode == "native")
    return engine


def _native():
    from s2moe import _cpu

    return _cpu


MODES = ["native", "python", "buffered"]


@pytest.mark.parametrize("mode", MODES)
def test_eio_on_expert_read_names_expert_and_file(model_copy, monkeypatch, mode):
    engine = _engine(model_copy, mode)

    def failing(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    if mode == "native":
        _native().io_inject(errno.EIO)
    monkeypatch.setattr(os, "pread" if mode == "buffered" else "preadv", failing)
    try:
        with pytest.raises(ExpertReadError) as exc:
            generate_ar(engine.model, [1, 2, 3], 4)
    finally:
        if mode == "native":
            _native().io_inject()
    msg = str(exc.value)
    assert "model.safetensors" in msg and "expert" in msg and "layer" in msg and "Input/output error" in msg


@pytest.mark.parametrize("mode", MODES)
def test_short_read_is_an_error_not_garbage(model_copy, monkeypatch, mode):
    engine = _engine(model_copy, mode)
    if mode == "native":
        _native().io_inject(0, 100)
    elif mode == "python":
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: min(real(fd, bufs, off), 100))
    else:
        real = os.pread
        monkeypatch.setattr(os, "pread", lambda fd, n, off: real(fd, n, off)[:100])
    try:
        with pytest.raises(ExpertReadError, match="short read"):
            generate_ar(engine.model, [1, 2, 3], 4)
    finally:
        if mode == "native":
            _native().io_inject()


def test_an_aligned_read_one_byte_short_is_an_error(tmp_path, monkeypatch):
    """An O_DIRECT read starts at the page boundary below the range, so it must return the alignment
    head (here 100 bytes) plus the range: one byte fewer is short even though it exceeds the range."""
    from s2moe.runtime.offload.reader import FileReader

    path = tmp_path / "f.bin"
    blob = np.random.default_rng(0).integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes()
    path.write_bytes(blob)
    reader = FileReader(direct=True)
    reader.fd(str(path))
    reader.direct_files[str(path)] = True  # the aligned path, also where this file system refuses O_DIRECT
    offset, nbytes = 4096 + 100, 5000
    assert reader.read(str(path), offset, nbytes, "a range").tobytes() == blob[offset:offset + nbytes]
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: min(real(fd, bufs, off), 100 + nbytes - 1))
    with pytest.raises(ExpertReadError, match="short read of a range"):
        reader.read(str(path), offset, nbytes, "a range")


@pytest.mark.parametrize("mode", ["native", "python"])
def test_model_file_rewritten_in_place_is_detected(model_copy, mode):
    engine = _engine(model_copy, mode)
    generate_ar(engine.model, [1, 2, 3], 2)  # opens the file
    path = os.path.join(model_copy, "model.safetensors")
    with open(path, "r+b") as f:  # same inode, new bytes and mtime
        f.seek(-16, 2)
        f.write(b"\0" * 16)
    os.utime(path, ns=(1, 1))
    engine.cache.clear()
    with pytest.raises(ExpertReadError, match="changed while running"):
        generate_ar(engine.model, [4, 5, 6], 4)


def test_cli_exit_code_for_read_failure(model_copy):
    path = os.path.join(model_copy, "model.safetensors")
    code = ("import os, errno, sys; real = os.preadv\n"
            "def bad(fd, b, off):\n    raise OSError(errno.EIO, 'Input/output error')\n"
            "os.preadv = bad\nfrom s2moe import _cpu\n_cpu.io_inject(errno.EIO)\nfrom s2moe.runtime.cli import main\n"
            f"sys.argv = ['s2moe', 'run', '-m', {model_copy!r}, '-p', 'def f', '-n', '4', '--method', 'ar']\nmain()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and "Traceback" not in r.stderr


def test_disk_full_while_writing_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "profile.json"
    target.write_text('{"old": true}\n')
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_json_atomic(str(target), {"new": list(range(1000))})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert json.loads(target.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["profile.json"]
