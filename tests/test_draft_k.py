"""How many experts the draft takes, chosen by measurement (calib/draft_k.py, `s2moe-calib profile`)."""

from __future__ import annotations

import json
import os

import pytest

from s2moe.calib import draft_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = os.path.join(ROOT, "tests", "data", "prompts.jsonl")


def test_candidates_run_from_one_to_twice_the_papers_k():
    assert draft_k.candidates(4, 2) == [1, 2, 3, 4]
    assert draft_k.candidates(8, 2) == [1, 2, 3, 4]
    assert draft_k.candidates(6, 1) == [1, 2, 3]
    assert draft_k.candidates(2, 1) == [1, 2]
    assert draft_k.candidates(1, 1) == [1]


def test_the_model_counts_kept_tokens_and_prices_passes():
    # every chain kept whole: g tokens of draft and one from verification, for g drafts and one AR step
    g, rate = draft_k.modeled([8] * 10, 0.1, 1.0, 8)
    assert g == 8 and rate == pytest.approx(9 / 1.8)
    # nothing kept: drafting never pays, AR (g = 0) is the answer
    assert draft_k.modeled([0] * 10, 0.01, 1.0, 8) == (0, 1.0)
    # half the chains keep 2, half keep none: 2 drafts give 2 tokens for 1.2 T_AR, 1 draft 1.5 for 1.1
    g, rate = draft_k.modeled([2, 0] * 5, 0.1, 1.0, 8)
    assert (g, rate) == (2, pytest.approx(2 / 1.2))
    assert draft_k.matched([5, 6, 7], [5, 6, 8, 9]) == 2 and draft_k.matched([1], [2]) == 0


def _measured(kept: dict, c_draft: dict) -> dict:
    n = len(next(iter(kept.values())))
    return {"t_ar": [1.0] * 5, "c_draft": {k: [v] * 5 for k, v in c_draft.items()}, "kept": kept,
            "first_token_agreement": {k: 0.5 for k in kept}, "blocks": [i % 10 for i in range(n)]}


def test_choose_trades_tokens_kept_against_the_draft_pass():
    kept = {1: [2] * 20, 2: [4] * 20, 3: [5] * 20}
    # cheap passes: the draft that keeps most wins, over the default k = 2
    k, record = draft_k.choose(_measured(kept, {1: 0.05, 2: 0.055, 3: 0.06}), 8, 2)
    assert k == 3 and record["chosen"] == 3 and record["default"] == 2
    assert set(record["candidates"]) == {"1", "2", "3"} and "over_default" in record["candidates"]["3"]
    # a third expert that doubles the pass's cost does not pay for one more token kept
    k, _ = draft_k.choose(_measured(kept, {1: 0.05, 2: 0.1, 3: 0.2}), 8, 2)
    assert k == 2
    # no better than the default: the default stays (fewer experts need no evidence)
    k, _ = draft_k.choose(_measured({1: [3] * 20, 2: [3] * 20}, {1: 0.1, 2: 0.1}), 8, 2)
    assert k == 2


def test_a_k_that_is_faster_only_within_the_noise_does_not_replace_the_default():
    # k = 3 keeps more on average, but only through two lucky prompts out of ten
    lucky = [8 if i % 10 in (0, 1) else 3 for i in range(40)]
    k, record = draft_k.choose(_measured({2: [3] * 40, 3: lucky}, {2: 0.05, 3: 0.05}), 8, 2)
    over = record["candidates"]["3"]["over_default"]
    assert over["mean"] > 0 and over["mean"] <= 2 * over["standard_error"] and k == 2
    # the same gain on every prompt is evidence
    k, _ = draft_k.choose(_measured({2: [3] * 40, 3: [4] * 40}, {2: 0.05, 3: 0.05}), 8, 2)
    assert k == 3
    assert draft_k.margin([1.0, 2.0], [1.0, 1.0], [0, 0]) == (0.5, float("inf"))  # one block: no evidence


def test_a_draft_that_is_the_target_keeps_every_token(tiny_model_dirs):
    """The chains line up with the target's continuation: a 'draft' routed as the target is the
    target, so every chain is kept whole and every first token agrees: an off-by-one in the truth
    or the roots would lose tokens."""
    from s2moe.runtime.engine import build_engine
    from s2moe.runtime.model.routing import TARGET, RoutingPolicy

    _, folder, _ = tiny_model_dirs["olmoe"]
    model = build_engine(folder).model
    k = model.config.top_k
    prompts = [[3, 17, 42, 9, 5], [11, 4, 8]]
    got = draft_k.measure(model, prompts, 12, [k, 1], 4,
                          lambda kk: TARGET if kk == k else RoutingPolicy(top_k=1))
    assert len(got["t_ar"]) == 24 and len(got["c_draft"][1]) == 24 * 4
    assert len(got["kept"][k]) == 2 * (12 - 4 + 1)  # steps with 4 target tokens from them on
    assert set(got["kept"][k]) == {4} and got["first_token_agreement"][k] == 1.0
    assert all(0 <= m <= 4 for m in got["kept"][1])
    # the continuations are not one repeated token, so whole chains at every step mean alignment
    from s2moe.runtime.decoding.generate import generate_ar

    assert all(len(set(generate_ar(model, p, 12).tokens)) > 2 for p in prompts)
    k_chosen, record = draft_k.choose(got, 4, 1)
    assert k_chosen in (k, 1) and record["steps"] == 24


def test_a_profile_chooses_the_draft_k_unless_told(tiny_model_dirs, tmp_path, monkeypatch):
    from s2moe.calib import profile_cmd

    _, folder, _ = tiny_model_dirs["olmoe"]
    data = profile_cmd.run_profile(folder, "cpu", "0.5", WORKLOAD, str(tmp_path / "p.json"), None, 12, None, 0.0, 1,
                                   4, rounds=1, n_prompts=1)
    spec = data["speculative"]
    choice = spec["draft_topk_choice"]
    assert spec["draft_topk"] == choice["chosen"]
    top_k = data["model"]["top_k"]
    assert [int(k) for k in choice["candidates"]] == draft_k.candidates(top_k, max(1, top_k // 2))
    assert choice["default"] == max(1, top_k // 2)
    chosen = choice["candidates"][str(choice["chosen"])]
    if choice["chosen"] != choice["default"]:  # only a k with evidence replaces the default
        assert chosen["over_default"]["mean"] > 2 * chosen["over_default"]["standard_error"]
    samples = json.loads((tmp_path / "p.samples.json").read_text())
    assert samples["draft_k_choice"] == choice  # an interrupted profile resumes without measuring it again
    # the choice is what the profile times C_draft with and records, whichever k it is
    real = draft_k.choose
    default = max(1, top_k // 2)
    other = 1 if default != 1 else 2

    def forced(measured, cap, default):
        return other, dict(real(measured, cap, default)[1], chosen=other)

    monkeypatch.setattr(draft_k, "choose", forced)
    data = profile_cmd.run_profile(folder, "cpu", "0.5", WORKLOAD, str(tmp_path / "f.json"), None, 12, None, 0.0, 1,
                                   4, rounds=1, n_prompts=1)
    assert data["speculative"]["draft_topk"] == other == data["speculative"]["draft_topk_choice"]["chosen"]
    from rich.console import Console

    console = Console(width=240, record=True, file=open(os.devnull, "w"))
    console.print(profile_cmd.summary_table(data))
    text = console.export_text()
    assert f"C_draft (draft k {other})" in text and f"{other}*: " in text  # the table says which k, and why
    monkeypatch.undo()
    # told: the given k, nothing measured
    data = profile_cmd.run_profile(folder, "cpu", "0.5", WORKLOAD, str(tmp_path / "q.json"), 1, 12, None, 0.0, 1,
                                   4, rounds=1, n_prompts=1)
    assert data["speculative"]["draft_topk"] == 1 and "draft_topk_choice" not in data["speculative"]
