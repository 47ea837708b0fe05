"""What a mutation is, and the names the mutation lists share (test selections, target files).

The lists themselves: `mutations.py` (the issue's own bugs and the first sets by area) and
`mutations_found.py` (the sets later read-only reviews, audits and stress runs found) and
`mutations_prefetch.py` (draft-guided prefetch into the cache and the streaming workspace).
"""

from __future__ import annotations

from dataclasses import dataclass


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
T_GGUF = ["tests/test_gguf_hostile.py"]
T_PROFILE = ["tests/test_reliability.py", "-k", "profile"]
T_EXPORT = ["tests/test_calib.py", "-k", "export"]
T_ADMIT = ["tests/test_admit_rules.py"]
T_INDEX = ["tests/test_reliability.py", "-k", "index or sharded"]
T_RESIDENT = ["tests/test_residency_gating.py"]
T_LIVE = ["tests/test_live_costs.py"]
T_COST = ["tests/test_calib.py", "-k", "by_hand or fit_recovers"]
T_FALLBACK = ["tests/test_reliability.py", "-k", "o_direct_refused"]

SPEC = "runtime/decoding/speculative.py"
ST = "runtime/model/formats/safetensors_index.py"
GGUF = "runtime/model/formats/gguf_index.py"
CACHE = "runtime/offload/cache.py"
POLICY = "runtime/offload/policies.py"
SPEC_OPTIONS = "runtime/cli/spec_options.py"
