"""One validation path for the numbers and lists that come from flags and profiles.

Every value a user can type or a profile can hold passes through here before it reaches the
runtime, so NaN, infinity, out-of-range counts and layer indices a model does not have all end the
same way: one line naming the flag or profile field, what it must be, and exit 2.
"""

from __future__ import annotations

import math

from .errors import UsageError


def number(where: str, value, *, low=None, high=None, low_open: bool = False, high_open: bool = False,
           integer: bool = False):
    """``value`` as a finite float (or int with ``integer``) within [low, high] (open ends on
    request); else one UsageError naming ``where`` (a flag such as ``--top-p``, or a profile field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where} {value!r}: must be a number")
    if not math.isfinite(value):
        raise UsageError(f"{where} {value}: must be a finite number")
    if integer and not float(value).is_integer():
        raise UsageError(f"{where} {value}: must be a whole number")
    if low is not None and (value <= low if low_open else value < low):
        raise UsageError(f"{where} {value}: must be {'>' if low_open else '>='} {low}")
    if high is not None and (value >= high if high_open else value > high):
        raise UsageError(f"{where} {value}: must be {'<' if high_open else '<='} {high}")
    return int(value) if integer else float(value)


def expert_pairs(entries, config, where: str) -> list[tuple[int, int]]:
    """A hot-expert list ``[[layer, expert], ...]`` checked against the model: pairs of integers,
    MoE layers only, experts in range, no duplicates."""
    if not isinstance(entries, list):
        raise UsageError(f"{where}: must be a list of [layer, expert] pairs")
    moe_layers = set(config.moe_layer_ids)
    seen: set[tuple[int, int]] = set()
    out = []
    for i, pair in enumerate(entries):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)):
            raise UsageError(f"{where}[{i}] = {pair!r} is not a [layer, expert] pair of integers")
        key = (int(pair[0]), int(pair[1]))
        if key[0] not in moe_layers:
            raise UsageError(f"{where}[{i}]: layer {key[0]} is not a MoE layer of this model "
                             f"(MoE layers: {min(moe_layers)}..{max(moe_layers)})")
        if not 0 <= key[1] < config.num_experts:
            raise UsageError(f"{where}[{i}]: expert {key[1]} out of range 0..{config.num_experts - 1}")
        if key in seen:
            raise UsageError(f"{where}[{i}]: duplicate entry [{key[0]}, {key[1]}]")
        seen.add(key)
        out.append(key)
    return out
