"""Tiny models of any transformers family from its own config class, PEFT's all-linear adapters on them, and
each module's delta as PEFT and as the derived spec's slots give it, at any world size."""

from __future__ import annotations

from pathlib import Path

import torch

# Every size field a family's config may have, shrunk; a field a family's config lacks is not passed.
SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "moe_intermediate_size": 16,
         "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
         "num_experts_per_tok": 2, "moe_k": 2, "shared_expert_intermediate_size": 16, "kv_lora_rank": 16,
         "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1,
         "topk_group": 1, "max_position_embeddings": 128, "depth": 2, "embed_dim": 32, "num_heads": 4,
         "out_hidden_size": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
         "mamba_head_dim": 16, "mamba_d_ssm": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1,
         "ssm_state_size": 8, "moe_shared_expert_intermediate_size": 16,
         "n_groups": 1, "conv_kernel": 4, "patch_size": 4, "image_size": 16, "num_channels": 3,
         "projector_hidden_size": 32, "vision_output_dim": 32, "num_global_layers": 1,
         "intermediate_size_mlp": 48, "mm_tokens_per_image": 4, "global_head_dim": 8,
         "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 64, "num_kv_shared_layers": 0,
         "first_k_dense_replace": 1, "moe_layer_start_index": 1, "attention_chunk_size": 16}


def tiny_config(model_type: str, **over):
    """A tiny config of model_type from transformers' own class: every size field its defaults have,
    shrunk, in nested configs too (text_config, vision_config); then over."""
    import transformers

    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    return transformers.AutoConfig.for_model(model_type, **{**shrink(defaults), **over})


def shrink(fields: dict) -> dict:
    """The size fields of a config's defaults, shrunk; a nested config by its own shrunk fields alone, so
    that what its class derives from them (layer_types, per-layer lists) follows."""
    out = {k: v for k, v in SMALL.items() if k in fields}
    for k, v in fields.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink(v)
    return out


def build(config, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The model config describes: a vision-language model's class where there is one, else the causal LM."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
            try:
                return auto.from_config(config).float().eval()
            except ValueError:
                continue
    raise ValueError(f"no auto class builds {config.model_type}")


def all_linear_adapter(tmp: Path, model: torch.nn.Module, name: str = "ad", seed: int = 1, **lora):
    """PEFT's own adapter on every linear (target_modules="all-linear", which for a transformers 5 MoE
    targets the stacked experts and the router too), its factors random, saved by PEFT."""
    import peft

    lora.setdefault("target_modules", "all-linear")
    lora.setdefault("r", 2)
    lora.setdefault("lora_alpha", 4)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp / name)
    return pm.eval(), tmp / name


# Experts classes that store [E, in, out] without saying so: Llama 4's forward is bmm(x, gate_up_proj).
UNMARKED_TRANSPOSED = {"Llama4TextExperts"}


def peft_deltas(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each LoRA layer's delta weight as PEFT computes it, as a linear's [out, in] (a conv's flattened), by the
    name a checkpoint gives it: a stacked parameter's LoRA named module.parameter (as WrappedKeys reads it),
    its delta [E, out, in] with gate rows then up rows, by what transformers' experts class declares of its
    layout (is_transposed: [E, in, out]; is_concatenated false: gate and up rows interleaved)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = {}
    for n, m in pm.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        name = n.removeprefix("base_model.model.")
        with torch.no_grad():
            delta = m.get_delta_weight("default").float()
        if isinstance(m, ParamWrapper) and delta.dim() == 3:
            while name.endswith(".base_layer"):
                name = name.removesuffix(".base_layer")
            name = f"{name}.{m.parameter_name}"
            experts = m.get_base_layer()
            if getattr(experts, "is_transposed", type(experts).__name__ in UNMARKED_TRANSPOSED):
                delta = delta.transpose(1, 2)
            gated = getattr(experts, "has_gate", True)
            if "gate_up" in m.parameter_name and gated and not getattr(experts, "is_concatenated", True):
                delta = torch.cat([delta[:, 0::2], delta[:, 1::2]], 1)
        out[name] = delta.flatten(1) if delta.dim() > 2 and not isinstance(m, ParamWrapper) else delta
    return out


def read_all(specs: dict, path: Path, world_size: int = 1) -> dict[str, list]:
    """Every node's copy of the adapter at path on each rank, checked first as a deployment checks it."""
    from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file

    nodes = list(specs.values())
    digest = check_adapter_file(nodes[0], "ad", path, nodes[1:])
    return {node: [LoraAdapterStore(spec, rank, world_size, pin=False, dtype=torch.float32).read("ad", path, digest)
                   for rank in range(world_size)] for node, spec in specs.items()}


def whole(spec, ranks: list, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's a and b put back together from every rank's shard (a rank holding replicated rows must hold
    what the others do): what the ranks hold between them."""
    from mstar.engine.resources.lora.layout import SlotLayout

    world = len(ranks)
    t, R = spec.targets[target], spec.max_rank
    a = torch.full((t.layers, t.slices * R, t.in_features), float("nan"))
    b = torch.full((t.layers, sum(t.out_features), R), float("nan"))
    starts = [sum(t.out_features[:s]) for s in range(t.slices)]
    for rank, adapter in enumerate(ranks):
        lay = SlotLayout(spec, rank, world, torch.float32).targets[target]
        c0, c1 = lay.shard.columns
        _place(a[:, :, c0:c1], adapter.a[target], f"{target} A rank {rank}")
        for s, (r0, r1) in enumerate(lay.shard.rows):
            rows = slice(starts[s] + r0, starts[s] + r1)
            _place(b[:, rows], adapter.b[target][:, lay.b_rows(s)], f"{target} B rank {rank}")
    assert not a.isnan().any() and not b.isnan().any(), f"{target}: the ranks do not cover it"
    return a, b


def _place(into: torch.Tensor, part: torch.Tensor, what: str) -> None:
    held = ~into.isnan()
    assert torch.equal(into[held], part[held]), f"{what}: replicated rows differ between ranks"
    into.copy_(part)


def slot_delta(spec, a: torch.Tensor, b: torch.Tensor, scaling: float, module: str) -> torch.Tensor:
    """DESIGN.md's delta of one module as a weight: scaling * B_s A_s of each slice it covers, slices stacked
    in the module's order (per expert for stacked experts: [E, out, in] as a linear's)."""
    target, layer, s = spec.locate(module)
    t, R = spec.targets[target], spec.max_rank
    starts = [sum(t.out_features[:i]) for i in range(t.slices)]
    parts = [scaling * b[layer, starts[i] : starts[i] + t.out_features[i]] @ a[layer, i * R : (i + 1) * R]
             for i in t.covered(s)]
    if t.experts is None or s is not None:
        return torch.cat(parts)
    per = t.slices // t.experts.count
    return torch.stack([torch.cat(parts[e * per : (e + 1) * per]) for e in range(t.experts.count)])


def assert_serves_peft(pm, specs: dict, path: Path, world_size: int = 1, tol: float = 1e-4) -> set[str]:
    """Every LoRA module of pm is located by one node and served with PEFT's delta (relative error under tol)
    from the ranks' shards put back together; returns the modules checked."""
    read = read_all(specs, path, world_size)
    checked = set()
    for module, want in peft_deltas(pm).items():
        nodes = [n for n, spec in specs.items() if spec.locate(module) is not None]
        assert len(nodes) == 1, f"{module}: located by {nodes or 'no node'}"
        spec, ranks = specs[nodes[0]], read[nodes[0]]
        target = spec.locate(module).target
        a, b = whole(spec, ranks, target)
        got = slot_delta(spec, a, b, ranks[0].scaling, module)
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < tol, f"{module} ({target}, world size {world_size}): relative error {err:.2e}"
        checked.add(module)
    return checked
