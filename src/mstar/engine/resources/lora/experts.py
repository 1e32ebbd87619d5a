"""Every expert's LoRA in one tensor pair, as PEFT's target_parameters saves it for stacked experts.

lora_A is [r * E, x] with expert-major rows (expert e's are rows e*r : (e+1)*r) and lora_B is [y, r * E]
with rank-major, expert-minor columns (expert e's are columns e, e + E, e + 2E, ...): reading B the way
A is read pairs every expert with the wrong columns, silently. Which side of the expert A sits on
depends on the PEFT version and the model: PEFT before 0.19 read a stacked parameter [E, d1, d2] as
[E, in, out], which is right for gpt-oss's [E, in, out] and puts A on the output side of Qwen3-MoE's
and Mixtral's [E, out, in]; 0.19.1 on reads both the right way round. The shapes against the model's
widths tell which; where they cannot (in and out alike), the adapter's peft_version does, or the
adapter is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .spec import LoraTarget

Orientation = Literal["A in", "A out"]  # lora_A on the expert's input side, or its output side


def stacked_widths(t: LoraTarget) -> tuple[int, int]:
    """(in, out) of one expert of an expert target: out spans all the expert's slices (gate and up)."""
    per = t.slices // t.experts.count
    return t.in_features, per * t.out_features[0]


def orientations(t: LoraTarget, a_shape: Sequence[int], b_shape: Sequence[int]) -> list[Orientation]:
    """The ways round the stacked factors fit the target's experts."""
    count, (fan_in, fan_out) = t.experts.count, stacked_widths(t)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] % count:
        return []
    fits: list[Orientation] = []
    if (a_shape[1], b_shape[0]) == (fan_in, fan_out):
        fits.append("A in")
    if t.experts.layout == "out_in" and (a_shape[1], b_shape[0]) == (fan_out, fan_in):
        fits.append("A out")
    return fits


def stacked_misfit(t: LoraTarget, name: str, a_shape: Sequence[int], b_shape: Sequence[int],
                   max_rank: int) -> str | None:
    """Why stacked factors do not fit target name, or None (they may still fit either way round)."""
    count, (fan_in, fan_out) = t.experts.count, stacked_widths(t)
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        return f"A {list(a_shape)} and B {list(b_shape)} are not a pair of stacked experts' factors"
    if a_shape[0] % count:
        return f"A {list(a_shape)} does not split into the model's {count} experts"
    if not orientations(t, a_shape, b_shape):
        return (f"A {list(a_shape)} / B {list(b_shape)} do not fit {count} experts of {fan_in} inputs and {fan_out} "
                f"outputs for target {name}")
    if a_shape[0] // count > max_rank:
        return f"rank {a_shape[0] // count} per expert, over this pool's max_rank {max_rank} for experts"
    return None


def orientation(t: LoraTarget, a_shape: Sequence[int], b_shape: Sequence[int],
                peft_version: str | None) -> Orientation | str:
    """Which side of each expert A sits on, or why that cannot be told."""
    fits = orientations(t, a_shape, b_shape)
    if len(fits) == 1:
        return fits[0]
    version = _version(peft_version)
    if version is not None and version >= (0, 19, 1):
        return "A in"
    if version is not None and version < (0, 19):
        return "A out"
    fan_in, fan_out = stacked_widths(t)
    return (f"its stacked factors fit either way round ({fan_in} inputs and {fan_out} outputs per expert) and "
            f"adapter_config.json's peft_version ({peft_version or 'none'}) does not settle it: PEFT before 0.19 put "
            "lora_A on the output side of [experts, out, in] parameters, 0.19.1 on the input side")


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits or digits != piece:
            return None  # a development or local version: not read as a number
        parts.append(int(digits))
    return tuple(parts)
