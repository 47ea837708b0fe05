from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_models as tm  # noqa: E402

CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
    "The quick brown fox jumps over the lazy dog. import os\nprint('hello world')\n"
) * 20


@pytest.fixture(scope="session")
def tiny_tokenizer_json(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer whose ids fit the tiny models' 384-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() <= 381
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer_json):
    """family -> (torch model, per-expert folder, fused folder); folders carry the tokenizer."""
    from helpers import save_families

    return save_families(tm.FAMILIES, tmp_path_factory, tiny_tokenizer_json)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _no_state_between_tests():
    """Process-wide state must not leak from one test into the next: the expert store's warn-once
    notes are forgotten before each test, so a test that expects a note sees it whatever ran first;
    the kernels' activation switch (set by the last CpuOps built) goes back to int8 after each."""
    from s2moe.runtime.offload import store

    reset = getattr(store, "reset_warnings", None)
    if reset is not None:
        reset()
    else:  # the store before its reader moved out: the set is _warn_once's default argument
        store._warn_once.__defaults__[0].clear()
    yield
    try:
        from s2moe import _cpu
    except ImportError:
        return
    if hasattr(_cpu, "act_q8"):  # a copy built before the switch existed (stress, mutants) has none
        _cpu.act_q8(1)
    if hasattr(_cpu, "rows4"):
        _cpu.rows4(1)
        _cpu.use_avx512(1)
        _cpu.use_vnni(1)


@pytest.fixture
def reference_kernels(monkeypatch):
    """Comparisons with transformers run the NumPy reference path (float32 BLAS products and a
    float32 softmax, as torch computes them); the compiled kernels are held to that reference,
    family by family, in test_kernels.py. Summation order alone moves float32 logits of these tiny
    models by up to 1.3e-5 between two correct implementations, the size of the fp16 rounding the
    transformers tolerance must still catch."""
    monkeypatch.setenv("S2MOE_KERNELS", "numpy")
    # transformers multiplies float activations; Q8_0 / Q4_0 GGUFs are held to it on dequantised
    # weights, which checks their layout, so int8 activations are off here (test_kernels.py holds
    # the int8 path to its own NumPy reference)
    monkeypatch.setenv("S2MOE_FLOAT_ACTIVATIONS", "1")
