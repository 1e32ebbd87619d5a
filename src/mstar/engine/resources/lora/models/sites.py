"""What a model's module tree says for LoRA: every linear, conv, router and stacked expert parameter, the
layer it sits in, its widths and the config it was built from.

The model may live on the meta device (transformers builds one from a config at no memory cost): only
shapes, classes and names are read, never values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

Kind = Literal["linear", "conv", "router", "stacked"]
Orientation = Literal["out_in", "in_out"]
# A config's expert count, as the families name it.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Site:
    """One adaptable weight in one layer, named as a checkpoint names its module: prefix, the layer index,
    then suffix (model.layers. 3 .self_attn.q_proj); a weight outside the layers has layer None and its whole
    name as suffix. A stacked expert parameter is named module.parameter (mlp.experts.gate_up_proj)."""

    prefix: str
    layer: int | None
    suffix: str
    kind: Kind
    in_features: int
    out_features: int
    config: Any  # the config of the (sub)model that built it: its heads and widths
    kernel: tuple[int, ...] | None = None
    experts: StackedExperts | None = None

    @property
    def name(self) -> str:
        return self.suffix if self.layer is None else f"{self.prefix}{self.layer}.{self.suffix}"

    @property
    def template(self) -> str:
        """The name with its layer as *, as transformers' tp_plan writes it."""
        return self.suffix if self.layer is None else f"{self.prefix}*.{self.suffix}"

    @property
    def leaf(self) -> str:
        return self.suffix.rpartition(".")[2]

    @property
    def parent(self) -> str:
        return self.suffix.rpartition(".")[0]


@dataclass(frozen=True)
class StackedExperts:
    """How a [E, d1, d2] parameter holds its experts: count, which side is the input, how many slices each
    expert's output holds (2 for a fused gate and up) and whether those interleave row by row."""

    count: int
    layout: Orientation
    per: int
    interleaved: bool


def sites(model: nn.Module) -> Iterator[Site]:
    """Every adaptable weight of model, in module order; ValueError naming a stacked parameter whose
    orientation neither its class nor its shape tells."""
    modules = dict(model.named_modules())
    for name, module in modules.items():
        config = _config(modules, name, model)
        prefix, layer, suffix = _split(modules, name)
        if isinstance(module, nn.Linear):
            yield Site(prefix, layer, suffix, "linear", module.in_features, module.out_features, config)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            if module.groups == 1:  # a depthwise conv (Mamba's, a linear attention's) is no linear on its patch
                kernel = tuple(module.kernel_size)
                yield Site(prefix, layer, suffix, "conv", module.in_channels * math.prod(kernel),
                           module.out_channels, config, kernel=kernel)
        else:
            yield from _parameters(module, prefix, layer, suffix, config)


def _parameters(module: nn.Module, prefix: str, layer: int | None, suffix: str, config: Any) -> Iterator[Site]:
    """A router's [experts, hidden] weight (a module of its own, not a Linear), and stacked experts."""
    count = getattr(module, "num_experts", None)
    weight = module._parameters.get("weight")
    if weight is not None and weight.dim() == 2 and weight.shape[0] in _expert_counts(config):
        yield Site(prefix, layer, suffix, "router", weight.shape[1], weight.shape[0], config)
    for pname, p in module.named_parameters(recurse=False):
        if p.dim() != 3 or count != p.shape[0]:
            continue
        full = f"{suffix}.{pname}" if suffix else pname
        layout = orientation(module, pname, tuple(p.shape), _hidden(config), f"{prefix}*.{full}")
        fan_out, fan_in = (p.shape[1], p.shape[2]) if layout == "out_in" else (p.shape[2], p.shape[1])
        gated = "gate_up" in pname and getattr(module, "has_gate", True) is not False
        interleaved = gated and not getattr(module, "is_concatenated", True)
        experts = StackedExperts(count, layout, 2 if gated else 1, interleaved)
        yield Site(prefix, layer, full, "stacked", fan_in, fan_out, config, experts=experts)


def orientation(module: nn.Module, pname: str, shape: tuple[int, int, int], hidden: int | None,
                where: str) -> Orientation:
    """Which side of a stacked [E, d1, d2] parameter is its input: as the class marks it (is_transposed:
    [E, in, out]; unmarked, transformers 5's experts are [E, out, in], as PEFT reads them), else by the shape,
    whose hidden-size side is the input of an up projection and the output of a down one."""
    marked = getattr(module, "is_transposed", None)
    if isinstance(marked, bool):
        return "in_out" if marked else "out_in"
    d1, d2 = shape[1:]
    down = "down" in pname
    if hidden is not None and d1 != d2 and hidden in (d1, d2):
        return "out_in" if (d2 == hidden) != down else "in_out"
    raise ValueError(f"stacked experts {where} {list(shape)}: neither its class ({type(module).__name__}, no "
                     f"is_transposed) nor its shape (hidden size {hidden}) tells which side is its input")


def _split(modules: dict[str, nn.Module], name: str) -> tuple[str, int | None, str]:
    """(prefix, layer, suffix): the layer is the first index into a ModuleList along the name."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and isinstance(modules.get(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[:i]) + ".", int(part), ".".join(parts[i + 1 :])
    return "", None, name


def _config(modules: dict[str, nn.Module], name: str, model: nn.Module) -> Any:
    """The config of the nearest module up the name that holds one (a vision tower's, a text model's)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        config = getattr(modules.get(".".join(parts[:i])), "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)):
            return config
    return getattr(model, "config", None)


def _expert_counts(config: Any) -> set[int]:
    return {v for f in EXPERT_COUNTS if isinstance(v := getattr(config, f, None), int) and v > 1}


def _hidden(config: Any) -> int | None:
    hidden = getattr(config, "hidden_size", None)
    return hidden if isinstance(hidden, int) else None
