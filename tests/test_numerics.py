"""The host tier's layout, read back by DESIGN.md's formula, gives PEFT's own delta."""

from __future__ import annotations

import pytest
import torch
from reference import VISION_25_MODULES, VISION_MODULES, lora_modules, module_input, peft_delta, slot_delta
from tiny import LM_TARGETS, make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "phi3-fused": ("phi3", {}),
    "rslora": ("llama", {"use_rslora": True, "r": 8, "lora_alpha": 5}),
    "rank-and-alpha-patterns": ("qwen2", {"rank_pattern": {"k_proj": 2, "layers.1.mlp.down_proj": 8},
                                          "alpha_pattern": {"v_proj": 3, r"layers\.2\.self_attn\.o_proj": 32}}),
    "rslora-with-patterns": ("llama", {"use_rslora": True, "rank_pattern": {"up_proj": 6},
                                       "alpha_pattern": {"q_proj": 1}}),
    "layer-subset": ("llama", {"layers_to_transform": [0, 2]}),
    "regex-targets": ("mistral", {"target_modules": r".*layers\.[12]\.(self_attn\.(q|v)_proj|mlp\.down_proj)"}),
    "qwen2-vl-vision": ("qwen2_vl", {"target_modules": LM_TARGETS + VISION_MODULES}),
    "qwen2.5-vl-vision": ("qwen2_5_vl", {"target_modules": r".*\.(" + "|".join(
        m.replace(".", r"\.") for m in LM_TARGETS + VISION_25_MODULES) + ")"}),
}


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_slot_layout_reproduces_peft_delta(tmp_path, case, adapter_dtype):
    arch, lora = CASES[case]
    config = model_config(arch)
    pm, path = make_adapter(tmp_path, arch, dtype=adapter_dtype, **lora)
    specs = specs_from_config(config, max_rank=8)
    pm = pm.float()  # bf16 factors are exact in fp32: the reference is PEFT's arithmetic, not rounding
    digest = check_adapter_file(specs["language_model"], "ad", path, list(specs.values())[1:])
    g = torch.Generator().manual_seed(0)
    checked = set()
    for spec in specs.values():
        adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path, digest)
        for module, layer in lora_modules(pm).items():
            if spec.locate(module) is None:
                continue
            x = module_input(layer, 5, g)
            want = peft_delta(layer, x)
            got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x.flatten(1))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{module}")
            checked.add(module)
    assert checked == set(lora_modules(pm)), "every module PEFT adapted is served by some node"


def test_store_dtype_bf16_folds_module_scaling_in_fp32_then_casts(tmp_path):
    _, path = make_adapter(tmp_path, "llama", alpha_pattern={"v_proj": 3, "down_proj": 5})
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    exact = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path)
    cast = LoraAdapterStore(spec, pin=False).read("ad", path)
    assert cast.digest == exact.digest, "the digest does not depend on the store's dtype"
    for t in exact.a:
        assert cast.a[t].dtype == cast.b[t].dtype == torch.bfloat16
        assert torch.equal(cast.a[t], exact.a[t].to(torch.bfloat16))
        assert torch.equal(cast.b[t], exact.b[t].to(torch.bfloat16))


def test_untouched_targets_absent_and_padding_zero(tmp_path):
    _, path = make_adapter(tmp_path, "llama", target_modules=["k_proj"], layers_to_transform=[1], r=3)
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path)
    assert set(adapter.a) == set(adapter.b) == {"qkv_proj"}
    a, b = adapter.a["qkv_proj"], adapter.b["qkv_proj"]
    assert a[1, 8:11].abs().sum() > 0 and b[1, 64:96, :3].abs().sum() > 0
    a[1, 8:11] = 0
    b[1, 64:96, :3] = 0
    assert a.abs().sum() == 0 and b.abs().sum() == 0, "only k's rows and columns of layer 1 hold weights"
    assert adapter.rank == 3 and adapter.nbytes == a.nbytes + b.nbytes
