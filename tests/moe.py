"""Tiny random mixture-of-experts models, their PEFT adapters, and each expert's delta as PEFT and the pool see it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

EXPERTS = 4
BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_experts_per_tok": 2, "vocab_size": 64, "pad_token_id": 0}
CONFIGS = {
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "intermediate_size": 64, "moe_intermediate_size": 24,
                  "num_experts": EXPERTS},
    "mixtral": {**BASE, "model_type": "mixtral", "intermediate_size": 24, "num_local_experts": EXPERTS},
    "gpt_oss": {**BASE, "model_type": "gpt_oss", "intermediate_size": 24, "num_local_experts": EXPERTS,
                "layer_types": ["sliding_attention", "full_attention"]},
}
INTER = 24
STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# per-expert module names as transformers 4 had them: (gate, up, down) under a layer
PER_EXPERT = {"qwen3_moe": ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
              "mixtral": ("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))}


def build(family: str, seed: int = 0, **over) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**CONFIGS[family], **over})).eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def stacked_adapter(tmp: Path, family: str, name: str = "ad", seed: int = 1, config: dict | None = None, **lora):
    """An adapter PEFT itself made on the model's stacked experts (target_parameters, every one unless told),
    with q_proj too; config overrides the model's."""
    import peft

    lora.setdefault("r", 2)
    lora.setdefault("lora_alpha", 4)
    lora.setdefault("target_modules", ["q_proj"])
    lora.setdefault("target_parameters", STACKED)
    pm = peft.get_peft_model(build(family, **(config or {})), peft.LoraConfig(**lora))
    randomize(pm, seed)
    pm.save_pretrained(tmp / name)
    return pm.eval(), tmp / name


def per_expert_adapter(tmp: Path, family: str, name: str = "pe", experts=range(EXPERTS), r: int = 2,
                       alpha: float = 4, seed: int = 2, layers: int | None = None, inter: int = INTER,
                       ) -> tuple[dict[str, torch.Tensor], Path]:
    """A per-expert adapter as PEFT saved one on transformers 4's expert modules (written out here: those
    modules no longer exist to train on), on the family's layers unless told."""
    prefix, (gate, up, down) = PER_EXPERT[family]
    hidden = CONFIGS[family]["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers or CONFIGS[family]["num_hidden_layers"]):
        for e in experts:
            for proj, fan_in, fan_out in ((gate, hidden, inter), (up, hidden, inter), (down, inter, hidden)):
                key = f"base_model.model.model.layers.{layer}.{prefix.format(e=e)}{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    path = tmp / name
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": [gate, up, down],
        "task_type": "CAUSAL_LM"}))
    return tensors, path


def peft_expert_deltas(pm: torch.nn.Module, family: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H] with gate rows then up rows, down [E, H, I]) deltas PEFT applies at layer,
    as a linear's [out, in] per expert."""
    experts = pm.base_model.model.model.layers[layer].mlp.experts
    down, gate_up = experts.get_delta_weight("default"), experts.base_layer.get_delta_weight("default")
    return stacked_as_linear(family, gate_up, down)


def stacked_as_linear(family: str, gate_up: torch.Tensor | None, down: torch.Tensor | None):
    """PEFT's deltas of the stacked parameters (as the parameters are laid out) as a linear's [E, out, in],
    gate rows then up rows."""
    if family == "gpt_oss":  # stored [E, in, out], gate and up interleaved in out
        if gate_up is not None:
            gate_up = gate_up.transpose(1, 2)
            gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1)
        if down is not None:
            down = down.transpose(1, 2)
    return gate_up, down


def pool_expert_deltas(adapter, spec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same deltas from a slot laid out by the pool: scaling * B A of each slice, gate then up."""
    R = spec.max_rank
    out = []
    for target, per in (("experts_gate_up", 2), ("experts_down", 1)):
        if target not in adapter.a:
            out.append(None)
            continue
        a, b = adapter.a[target][layer], adapter.b[target][layer]
        width = b.shape[0] // (EXPERTS * per)
        slices = [adapter.scaling * b[s * width : (s + 1) * width] @ a[s * R : (s + 1) * R]
                  for s in range(EXPERTS * per)]
        out.append(torch.stack([torch.cat(slices[e * per : (e + 1) * per]) for e in range(EXPERTS)]))
    return tuple(out)


def specs(family, max_rank=8, max_expert_rank=4, **over):
    from mstar.engine.resources.lora import specs_from_config

    return specs_from_config({**CONFIGS[family], **over}, max_rank=max_rank, max_expert_rank=max_expert_rank)


def read(family, path, rank=0, world_size=1, store=None, **over):
    """The experts node's copy of the adapter at path, checked first as a deployment checks it."""
    from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file

    s = specs(family, **over)
    digest = check_adapter_file(s["language_model"], "ad", path, [s["experts"]])
    if store is None:  # an empty store is falsy: it has no adapters yet
        store = LoraAdapterStore(s["experts"], rank, world_size, pin=False, dtype=torch.float32)
    return s["experts"], store.read("ad", path, digest)


def assert_deltas(adapter, spec, want_gate_up, want_down, layer, msg=""):
    gate_up, down = pool_expert_deltas(adapter, spec, layer)
    for name, got, want in (("gate_up", gate_up, want_gate_up), ("down", down, want_down)):
        assert (got is None) == (want is None), f"{name} {msg}: served {got is not None}, PEFT {want is not None}"
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} {msg}")


MANY = {"num_hidden_layers": 32, "num_experts": 128}  # a header of thousands of modules of a few templates
ODD = "model.layers.31.mlp.experts.97"  # the one module each of many_experts_variants gets wrong


def many_experts_variants(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """A per-expert adapter on 32 layers of 128 experts as saved, and copies of it each wrong in one place, in
    expert 97 of layer 31 (or beside it): name -> (folder, the module refused, words its refusal holds)."""
    tensors, plain = per_expert_adapter(tmp, "qwen3_moe", "plain", range(MANY["num_experts"]),
                                        layers=MANY["num_hidden_layers"])
    key, hidden = f"base_model.model.{ODD}", CONFIGS["qwen3_moe"]["hidden_size"]
    out = {"plain": (plain, "", "")}
    changes = {
        "wrong-shape": ("up_proj", {".up_proj.lora_B.weight": torch.zeros(INTER + 1, 2)},
                        "B [25, 2] should be [24, 2]"),
        "over-rank": ("gate_proj", {".gate_proj.lora_A.weight": torch.zeros(5, hidden),
                                    ".gate_proj.lora_B.weight": torch.zeros(INTER, 5)}, "over this pool's max_rank 4"),
        "config-rank": ("gate_proj", {".gate_proj.lora_A.weight": torch.zeros(3, hidden),
                                      ".gate_proj.lora_B.weight": torch.zeros(INTER, 3)}, "gives it r=2"),
        "dtype": ("down_proj", {".down_proj.lora_A.weight": torch.zeros(2, INTER, dtype=torch.float16)},
                  "factors of dtype F16 / F32"),
        # two A and no B: as many keys as modules' pairs, each two one module's, but under one role
        "doubled": ("down_proj", {".down_proj.lora_A.default.weight": torch.zeros(2, INTER),
                                  ".down_proj.lora_B.weight": None}, "two keys read as its A"),
        "lacking": ("up_proj", {".up_proj.lora_B.weight": None}, "lora_B is missing"),
        # gate's A beside up's B: keys two by two again, each two of two modules
        "unpaired": ("gate_proj", {".gate_proj.lora_B.weight": None, ".up_proj.lora_A.weight": None},
                     "lora_B is missing"),
    }
    for name, (proj, change, words) in changes.items():
        changed = {**tensors, **{key + k: v for k, v in change.items()}}
        out[name] = (_saved(tmp / name, {k: v for k, v in changed.items() if v is not None}, plain),
                     f"{ODD}.{proj}", words)
    past = {**tensors, **{k.replace(".experts.97.", ".experts.128."): v.clone() for k, v in tensors.items()
                          if f"{ODD}.down_proj" in k}}
    out["past"] = (_saved(tmp / "past", past, plain), ODD.replace("97", "128") + ".down_proj", "past the model's 128")
    beyond = {**tensors, **{k.replace("layers.31.", "layers.32."): v.clone() for k, v in tensors.items()
                            if f"{ODD}.down_proj" in k}}
    out["layer-past"] = (_saved(tmp / "layer-past", beyond, plain), "model.layers.32.mlp.experts.97.down_proj",
                         "layer 32 is past the 32 layers")
    head = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(2, hidden),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(CONFIGS["qwen3_moe"]["vocab_size"], 2)}
    out["lm-head"] = (_saved(tmp / "lm-head", head, plain), "lm_head", "LoRA on lm_head is not served")
    return out


def _saved(path: Path, tensors: dict[str, torch.Tensor], like: Path) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text((like / "adapter_config.json").read_text())
    return path
