"""Hugging Face folders saved in BF16 and F16 (how released checkpoints ship), for every family:
logits match transformers run in float32 on the same rounded weights, and the weights stay
resident in their stored encoding."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import tiny_models as tm
import torch
from helpers import check_prefill_decode_verify


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", tm.FAMILIES + tm.EXTRA_FAMILIES)
def test_a_half_precision_folder_matches_transformers(family, dtype, tmp_path, tiny_tokenizer_json, rng):
    model = tm.build(family)
    half = copy.deepcopy(model).to(getattr(torch, dtype))
    folder = tm.save(half, tmp_path / family, fused=False)
    shutil.copy(tiny_tokenizer_json, os.path.join(folder, "tokenizer.json"))
    # the reference: the rounded weights (and saved buffers) in float32 arithmetic; RoPE's
    # frequencies are not saved, so they stay the float32 model's
    reference, saved = copy.deepcopy(model), half.state_dict()
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if name in saved:
                tensor.copy_(saved[name].float())
    model = check_prefill_decode_verify(reference, folder, rng)
    stored = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    ref = next(iter(model.loaded.experts.values()))  # and kept so: resident bytes are stored bytes
    assert ref.storage_type == stored, f"{family}: experts stored as {ref.storage_type}, not {stored}"
    # per-expert tensors stay as stored; GPT-OSS's interleaved gate/up is split into float32 rows
    # at load (offload/experts.py `kept_stored`; docs/memory.md says so)
    assert ref.resident_bytes_for(False) == ref.stored_bytes * (1 if ref.layout == "split" else 2)
    assert (ref.layout == "split") == (family != "gpt_oss")
