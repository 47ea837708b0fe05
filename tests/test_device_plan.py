"""`s2moe info --device`: the memory plan of a model the size users run on a device preset, in one
line, with a budget that fits. The model is a Qwen3-30B-A3B-shaped file in Q4_K_M's two types
(benchmarks/real_models.py), written sparse: 19.9 GB of headers and holes, a few MB on disk."""

from __future__ import annotations

import json
import os

import pytest

from helpers import one_line_error, s2moe
from s2moe.runtime.cli.info import RESERVE_UNIFIED

GiB = 1 << 30


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory):
    from benchmarks import real_models

    path = str(tmp_path_factory.mktemp("sparse") / "qwen3-30b-a3b-q4_k_mix.gguf")
    real_models.write("qwen3-30b-a3b", "Q4_K_MIX", path, sparse=True)
    assert os.path.getsize(path) > 18 * GiB and os.stat(path).st_blocks * 512 < 64 << 20  # holes, not bytes
    return path


def test_a_30b_model_on_a_16_gb_orin_is_planned_in_one_line_and_fits(qwen3_30b):
    code, stdout, _ = s2moe("info", "--model", qwen3_30b, "--device", "orin-16g", "--json")
    assert code == 0
    facts = json.loads(stdout)
    plan = facts["device_plan"]
    assert facts["architecture"] == "qwen3_moe" and facts["experts_total"] == 48 * 128
    assert plan["unified_memory"] and plan["memory_bytes"] == 16 * GiB
    # the parts add up to what the model takes, within the memory less the system's share
    parts = plan["dense_bytes"] + plan["expert_capacity_bytes"] + plan["kv_bytes"] + plan["work_bytes"]
    assert parts == plan["model_bytes"] <= 16 * GiB - RESERVE_UNIFIED and plan["fits"]
    # experts at their stored bytes on the device: the share is what the memory leaves for them
    assert plan["expert_total_bytes"] == facts["expert_bytes_stored_total"]
    assert plan["expert_capacity_bytes"] == int(plan["expert_share"] * plan["expert_total_bytes"]) or \
        abs(plan["expert_capacity_bytes"] / plan["expert_total_bytes"] - plan["expert_share"]) < 1e-4
    assert 0.5 < plan["expert_share"] < 0.8
    assert plan["kv_cache_type"] == "f16"  # as a device run keeps it: the fused attention reads f16
    _, full, _ = s2moe("info", "--model", qwen3_30b, "--device", "orin-16g", "--cache-type", "f32", "--json")
    full = json.loads(full)["device_plan"]
    assert full["kv_bytes"] == 2 * plan["kv_bytes"] and full["expert_capacity_bytes"] < plan["expert_capacity_bytes"]
    code, table, _ = s2moe("info", "--model", qwen3_30b, "--device", "orin-16g")
    line = table.splitlines()[0]
    assert code == 0 and line == plan["line"]
    for part in ("orin-16g", "unified", "dense", "experts", "% resident", "KV", "workspace", "NVMe"):
        assert part in line, part


def test_the_whole_model_is_resident_where_the_memory_holds_it(qwen3_30b):
    code, stdout, _ = s2moe("info", "--model", qwen3_30b, "--device", "orin-64g", "--json")
    plan = json.loads(stdout)["device_plan"]
    assert code == 0 and plan["expert_share"] == 1.0 and "every expert resident" in plan["line"]


def test_a_device_too_small_for_the_dense_part_is_a_one_line_error(qwen3_30b, tmp_path):
    small = tmp_path / "tiny-orin.json"
    small.write_text(json.dumps({"device": {"kind": "orin", "memory_bytes": 3 * GiB}}))
    code, _, err = s2moe("info", "--model", qwen3_30b, "--device", str(small))
    one_line_error(code, err, "--device tiny-orin", "dense part, KV and workspace", "--ctx-size")


def test_an_unknown_device_is_a_one_line_error(tmp_path):
    code, _, err = s2moe("info", "--device", "orin-8g")
    one_line_error(code, err, "orin-8g", "orin-16g", "rtx4090")
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    code, _, err = s2moe("info", "--device", str(bad))
    one_line_error(code, err, "p.json", "device.memory_bytes")
