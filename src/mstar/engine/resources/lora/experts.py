"""Every expert's LoRA in one tensor pair, as PEFT's target_parameters saves it for stacked experts.

lora_A is [r * E, x] with expert-major rows (expert e's are rows e*r : (e+1)*r) and lora_B is [y, r * E]
with rank-major, expert-minor columns (expert e's are columns e, e + E, e + 2E, ...): reading B the way
A is read pairs every expert with the wrong columns, silently. Which side of the expert A sits on
depends on the experts class PEFT wrapped, not on PEFT's version: PEFT (0.21.2 too) reads a parameter
[E, d1, d2] as [E, in, out] where the experts are marked is_transposed (gpt-oss under transformers 5)
and as [E, out, in] where not (Qwen3-MoE and Mixtral under 5, gpt-oss under 4.57, whose [E, in, out]
thus gets A on its output side). So the shapes against the model's widths tell which; a square expert
(in and out alike) takes the side its file's other stacked experts show, as PEFT decides it once for
every parameter of an experts class; where none shows it, the adapter is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from .keys import ModuleKeys
from .spec import LoraSpec, LoraTarget

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

Orientation = Literal["A in", "A out"]  # lora_A on the expert's input side, or its output side


def stacked_widths(t: LoraTarget) -> tuple[int, int]:
    """(in, out) of one expert of an expert target: out spans all the expert's slices (gate and up)."""
    per = t.slices // t.experts.count
    return t.in_features, per * t.out_features[0]


def orientations(t: LoraTarget, a_shape: Sequence[int], b_shape: Sequence[int]) -> list[Orientation]:
    """The ways round the stacked factors fit the target's experts: both where an expert is square."""
    count, (fan_in, fan_out) = t.experts.count, stacked_widths(t)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] % count:
        return []
    fits: list[Orientation] = []
    if (a_shape[1], b_shape[0]) == (fan_in, fan_out):
        fits.append("A in")
    if (a_shape[1], b_shape[0]) == (fan_out, fan_in):
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
                f"outputs for target {name}, either way round")
    if a_shape[0] // count > max_rank:
        return f"rank {a_shape[0] // count} per expert, over this pool's max_rank {max_rank} for experts"
    return None


def checkpoint_orientations(spec: LoraSpec, ckpt: Checkpoint) -> dict[str, Orientation | str]:
    """stacked_orientations of a checkpoint's modules as spec reads them: once per header and spec, for its
    inspection and its plan alike."""
    key = ("orientations", spec)
    if not any(t.experts is not None for t in spec.targets.values()):  # no stacked module to orient
        return {}
    if key not in ckpt.header.memo:
        ckpt.header.memo[key] = stacked_orientations(spec, ckpt.modules(spec.convert_keys))
    return ckpt.header.memo[key]


def stacked_orientations(spec: LoraSpec, modules: Mapping[str, ModuleKeys]) -> dict[str, Orientation | str]:
    """Which side of each expert A sits on, for every stacked module of spec's among modules (a checkpoint's),
    or why that cannot be told. A function of the shapes and the spec alone, so one header reads one way."""
    stacking = {n for n, t in spec.targets.items() if t.experts is not None}
    if not stacking:
        return {}
    names = list(modules)
    # the few modules on an expert target with no slice, found in one pass over their locations (a per-expert
    # file's tens of thousands of modules each name their expert, a slice, and are none of them)
    stacked = [(m, loc) for m, loc in zip(names, spec.locate_all(names), strict=True)
               if loc is not None and loc.slice is None and loc.target in stacking]
    fits = {}
    for module, loc in stacked:
        roles = modules[module].roles
        a, b = roles.get("A"), roles.get("B")
        if a is None or b is None:
            continue
        t = spec.targets[loc.target]
        fits[module] = (t, orientations(t, a.shape, b.shape))
    shown = {ways[0] for _, ways in fits.values() if len(ways) == 1}
    out: dict[str, Orientation | str] = {}
    for module, (t, ways) in fits.items():
        if len(ways) == 1:
            out[module] = ways[0]
        elif len(ways) == 2 and len(shown) == 1:
            out[module] = next(iter(shown))
        elif len(ways) == 2:
            out[module] = _square(t, shown)
    return out


def _square(t: LoraTarget, shown: set[str]) -> str:
    fan_in, fan_out = stacked_widths(t)
    why = ("the file's other stacked experts disagree on it" if shown
           else "no other stacked expert in the file shows which")
    return (f"its stacked factors fit either way round ({fan_in} inputs and {fan_out} outputs per expert) and {why}: "
            "PEFT puts lora_A on the input side of experts marked is_transposed (gpt-oss under transformers 5) and "
            "on the output side of gpt-oss's under transformers 4.57, whatever its own version, and nothing in the "
            "adapter names the transformers version it was trained with")
