"""Start like mmap (offload/fill.py): at full residency the prompt reads only what it needs, the rest
is read on the fetch threads after it, and no expert is read twice."""

from __future__ import annotations

import json
import subprocess
import sys

from s2moe.runtime.cli.common import DEFAULT_MODEL
from s2moe.runtime.engine import build_engine, phase_of


def _run(load: str, n: int = 40) -> dict:
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-p", "def fib(n):", "-n", str(n), "-t", "0",
                        "--method", "ar", "--load", load, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_background_fill_gives_the_same_tokens_and_reads_each_expert_once():
    now, lazy = _run("now"), _run("background")
    assert now["tokens"] == lazy["tokens"]
    cache = lazy["stats"]["offload"]["cache"]
    phases = cache["phases"]
    total = lazy["stats"]["offload"]["memory"]["expert_stored_bytes"]
    assert sum(p["bytes_read"] for p in phases.values()) == total  # every expert read, none twice
    assert 0 < phases["prefill"]["bytes_read"] < total  # the prompt read what it needed, not everything
    assert phases["load"]["bytes_read"] > 0 and cache["fill"]["left"] == 0 and cache["fill"]["kept"] > 0
    assert cache["resident_experts"] == now["stats"]["offload"]["cache"]["resident_experts"]
    assert now["stats"]["offload"]["cache"]["phases"]["load"]["bytes_read"] == total
    assert "fill" not in now["stats"]["offload"]["cache"]


def test_the_fill_waits_for_the_prompt_and_passes_take_its_reads_over():
    """Nothing is read beside start-up's cost estimate or the prompt; the first pass after them
    starts the fill, and a pass that needs an expert in flight takes that read over."""
    engine = build_engine(str(DEFAULT_MODEL), kv_positions=64, preload="background")
    model, cache = engine.model, engine.cache
    kv = model.new_cache(64)
    with phase_of(model, "estimate"):  # start-up's timed passes (decoding/estimate.py)
        model.forward(list(range(100, 104)), model.new_cache(8), logits="last")
    with phase_of(model, "prefill"):
        model.forward(list(range(100, 120)), kv, logits="last")
    assert cache.fill.started_at is None and not cache.fill.inflight  # nothing read beside the prompt
    after_prompt = len(cache.held)
    with phase_of(model, "ar"):
        model.forward([5], kv, logits="last")  # starts the fill: reads in flight
    assert cache.fill.inflight
    wanted = next(iter(cache.fill.inflight))
    cache.get(wanted[0], [wanted[1]])  # a pass that needs an expert in flight takes that read over
    assert cache.fill.taken == 1 and wanted in cache.held
    for _ in range(400):
        if not cache.fill.active:
            break
        with phase_of(model, "ar"):
            model.forward([5], kv, logits="last")
    c = model.config
    assert not cache.fill.active and len(cache.held) == c.num_layers * c.num_experts > after_prompt
    assert cache.report()["fill"]["seconds"] is not None and cache.report()["fill"]["left"] == 0
    assert cache.report()["phases"]["load"]["bytes_read"] + sum(
        s["bytes_read"] for name, s in cache.report()["phases"].items() if name != "load") == \
        engine.loaded.expert_stored_bytes
    engine.close()


def test_closing_with_reads_in_flight_is_clean():
    engine = build_engine(str(DEFAULT_MODEL), kv_positions=64, preload="background")
    kv = engine.model.new_cache(64)
    with phase_of(engine.model, "ar"):
        engine.model.forward([1, 2, 3], kv, logits="last")
        engine.model.forward([4], kv, logits="last")
    assert engine.cache.fill.active
    left = len(engine.cache.fill.pending) + len(engine.cache.fill.inflight)
    engine.close()
    assert not engine.cache.fill.active
    assert engine.cache.report()["fill"]["left"] == left > 0 and engine.cache.report()["fill"]["seconds"] is None


def test_load_takes_background_or_now_only():
    r = subprocess.run([sys.executable, "-m", "s2moe.runtime.cli", "run", "-p", "x", "-n", "2", "--load", "later"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--load 'later'" in r.stderr and "Traceback" not in r.stderr
