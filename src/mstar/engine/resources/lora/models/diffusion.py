"""A diffusers model's LoraSpec derived from the model diffusers builds from its config on the meta device:
SDXL's UNet2DConditionModel, SD3, Flux 2, Qwen-Image, HunyuanVideo, LTX-Video, and any other class diffusers
names in a config's _class_name.

The tree gives every linear and conv (a UNet's convs become linears over the flattened patch, the seed's
"conv adapters as linear"); diffusers has no tensor-parallel plan, so the rules here give one, by the roles
diffusers' own attention and feed-forward modules name: an attention's q, k, v (and added q, k, v) are
column-parallel, fused, sliced by its heads; its output projections row-parallel; a feed-forward's input
column-parallel, two slices where it is gated (its output is twice what its second linear reads: GEGLU,
SwiGLU), and its output row-parallel. A projection that packs q, k, v and the MLP (Flux 2's single blocks)
is sliced by its attention's heads and the MLP's rows. Everything else (modulations, embedders, convs, a
parallel block's output, which reads attention and MLP outputs concatenated) is replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..spec import LoraSpec, LoraTarget
from .derived import specs_from_model
from .diffusion_keys import DiffusersKeys
from .sites import sites

# Each denoiser's pipeline, whose lora_state_dict converts its trainers' layouts (traced.py).
PIPELINES = {"SD3Transformer2DModel": "StableDiffusion3Pipeline", "Flux2Transformer2DModel": "Flux2Pipeline",
             "QwenImageTransformer2DModel": "QwenImagePipeline",
             "HunyuanVideoTransformer3DModel": "HunyuanVideoPipeline", "LTXVideoTransformer3DModel": "LTXPipeline"}
FUSED = (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"))
QKV = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}
OUT = {"to_out.0", "to_add_out"}
PACKED_QKV_MLP = {"to_qkv_mlp_proj"}
# A feed-forward's (input linear, output linear), as diffusers' modules name them (FeedForward's net,
# Flux 2's linear_in / linear_out).
FEED_FORWARD = (("net.0.proj", "net.2"), ("linear_in", "linear_out"))


def denoiser_node(model: nn.Module) -> str:
    """What a pipeline calls the model: "unet" for a UNet, "transformer" for any other denoiser."""
    return "unet" if "UNet" in type(model).__name__ else "transformer"


def meta_model(raw: Mapping[str, Any], source: str) -> nn.Module:
    """The diffusers model raw's _class_name names, built from raw on the meta device; ValueError where
    diffusers is missing, does not know the class or refuses the config."""
    name = raw.get("_class_name")
    try:
        import diffusers
    except ImportError:
        raise ValueError(f"{source}: {name} is a diffusers model, and diffusers, which would derive its spec, "
                         "is not installed") from None
    cls = getattr(diffusers, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ValueError(f"{source}: unknown architecture {name!r}: neither a builder here nor diffusers "
                         f"{diffusers.__version__} knows it")
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            return cls.from_config(fields)
    except Exception as e:  # diffusers' own validation, whatever it raises
        raise ValueError(f"{source}: diffusers cannot build {name} from it: {str(e)[:200]}") from None


def plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan, in transformers' form, the rules above give model."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for s in sites(model):
        if s.kind != "linear":
            continue
        style = _style(modules, s.name)
        if style:
            out[s.template] = style
    return out


def _style(modules: Mapping[str, nn.Module], name: str) -> str | None:
    parent, _, leaf = name.rpartition(".")
    owner = modules.get(parent)
    if leaf in QKV and _heads(owner):
        return "colwise"
    if any(name.endswith("." + o) for o in OUT) and _attention(modules, name):
        return "rowwise"
    if leaf in PACKED_QKV_MLP and _heads(owner):
        return "colwise"
    for up, down in FEED_FORWARD:
        for mine, other, style in ((up, down, "colwise"), (down, up, "rowwise")):
            if name.endswith("." + mine) and isinstance(modules.get(name[: -len(mine)] + other), nn.Linear):
                return style
    return None


def _attention(modules: Mapping[str, nn.Module], name: str) -> nn.Module | None:
    """The attention module an output projection (to_out.0, to_add_out) belongs to."""
    parent = name.rsplit(".", 2 if name.endswith(".to_out.0") else 1)[0]
    owner = modules.get(parent)
    return owner if _heads(owner) else None


def _heads(module: nn.Module | None) -> int | None:
    heads = getattr(module, "heads", None)
    return heads if isinstance(heads, int) and heads > 0 else None


def diffusion_spec(model: nn.Module, *, max_rank: int, text_encoders: tuple[str, ...] = (), **kw: Any) -> LoraSpec:
    """The denoiser's LoraSpec, derived (specs_from_model) under the plan and fusions above, its column
    targets then given the slices and heads diffusers' modules say; it reads its pipeline's keys, serving
    the text encoders named by their own nodes."""
    derived = specs_from_model(model, max_rank=max_rank, tp_plan=plan(model), fuse=FUSED, **kw)
    (spec,) = derived.values()  # a diffusers model has no vision tower or experts
    modules = dict(model.named_modules())
    spec = _unfuse_cross_attention(spec, modules)
    targets = dict(spec.targets)
    for name, module in modules.items():
        loc = spec.locate(name) if isinstance(module, nn.Linear) else None
        if loc is None or (targets[loc.target].parallel != "column" and not name.endswith(tuple(PACKED_QKV_MLP))):
            continue
        targets[loc.target] = _sliced(targets[loc.target], modules, name, module, loc.slice)
    node = denoiser_node(model)
    names = frozenset(n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)))
    per_block = getattr(getattr(model, "config", None), "layers_per_block", None)
    keys = DiffusersKeys(node, names, tuple(text_encoders), PIPELINES.get(type(model).__name__),
                         per_block if node == "unet" and isinstance(per_block, int) else None)
    return dataclasses.replace(spec, targets=targets, name=node, convert_keys=keys,
                               patterns=spec.patterns + _joined(spec))


def _joined(spec: LoraSpec) -> tuple[tuple[str, str, None], ...]:
    """A pattern for each fused target's members named as one module (transformer_blocks.0.attn.to_q+to_k+to_v),
    as a fused projection split among them by diffusers' conversion reads (traced.py): every slice, in order."""
    out = []
    for name in spec.targets:
        leaves = name.rpartition(".")[2].split("+")
        first = [r for r, t, s in spec.patterns if t == name and s == 0]
        if len(leaves) > 1 and first:
            out.append((first[0] + "".join(re.escape("+" + leaf) for leaf in leaves[1:]), name, None))
    return tuple(out)


def _sliced(t: LoraTarget, modules: Mapping[str, nn.Module], name: str, module: nn.Linear,
            s: int | None) -> LoraTarget:
    """t with the slices and heads the module on slice s (None: every slice) tells."""
    parent, _, leaf = name.rpartition(".")
    heads = _heads(modules.get(parent))
    if leaf in PACKED_QKV_MLP and s is None and t.slices == 1 and heads:
        dim, mlp = module.in_features, module.out_features - 3 * module.in_features
        hidden = getattr(modules.get(parent), "mlp_hidden_dim", None)
        gated = (hidden, hidden) if isinstance(hidden, int) and mlp == 2 * hidden else (mlp,)  # gate, then up
        return dataclasses.replace(t, out_features=(dim, dim, dim, *gated), heads=(heads,) * 3 + (None,) * len(gated),
                                   parallel="column")
    if leaf in QKV and heads:
        q_width = _q_width(modules, parent, module)
        head_dim = q_width // heads
        now = list(t.heads or (None,) * t.slices)
        for sl in t.covered(s):
            if t.out_features[sl] % head_dim == 0:
                now[sl] = t.out_features[sl] // head_dim
        return dataclasses.replace(t, heads=tuple(now))
    for up, down in FEED_FORWARD:
        other = modules.get(name[: -len(up)] + down) if name.endswith("." + up) else None
        if isinstance(other, nn.Linear) and t.slices == 1 and module.out_features == 2 * other.in_features:
            half = other.in_features
            return dataclasses.replace(t, out_features=(half, half), heads=None)
    return t


def _q_width(modules: Mapping[str, nn.Module], parent: str, module: nn.Linear) -> int:
    q = modules.get(f"{parent}.to_q")
    return q.out_features if isinstance(q, nn.Linear) else module.out_features


def _is_cross(attention: nn.Module | None, name: str) -> bool:
    """Whether an attention's keys and values read another input than its queries (the text): as diffusers'
    Attention marks it, else (LTX's, unmarked) by the name diffusers' blocks give a cross-attention."""
    marked = getattr(attention, "is_cross_attention", None)
    if isinstance(marked, bool):
        return marked
    return name.rpartition(".")[2] == "attn2"


def _unfuse_cross_attention(spec: LoraSpec, modules: Mapping[str, nn.Module]) -> LoraSpec:
    """spec with a cross-attention's q kept apart from its k and v, which read the text: fused by width alone
    where the text's width is the model's, they would be one matmul over two inputs."""
    fused = "to_q+to_k+to_v"
    targets, patterns = dict(spec.targets), list(spec.patterns)
    for name, t in spec.targets.items():
        if not name.endswith(fused):
            continue
        owner = next((n.rpartition(".")[0] for n in modules if spec.locate(n) and spec.locate(n).target == name), None)
        if owner is None or not _is_cross(modules.get(owner), owner):
            continue
        base = name.removesuffix(fused)
        heads = t.heads or (None,) * 3
        del targets[name]
        targets[base + "to_q"] = dataclasses.replace(t, out_features=t.out_features[:1], heads=heads[:1])
        targets[base + "to_k+to_v"] = dataclasses.replace(t, out_features=t.out_features[1:], heads=heads[1:])
        patterns = [(r, base + "to_q", None) if (tt, s) == (name, 0) else
                    (r, base + "to_k+to_v", s - 1) if tt == name else (r, tt, s) for r, tt, s in patterns]
    if targets == dict(spec.targets):
        return spec
    return dataclasses.replace(spec, targets=targets, patterns=tuple(patterns))
