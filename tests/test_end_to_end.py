"""A mixed batch through a tiny model with the pool's op hooked in gives, row by row, PEFT's logits."""

from __future__ import annotations

import peft
import pytest
import torch
from reference import VISION_MODULES
from tiny import LM_TARGETS, build_model, make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file
from mstar.engine.resources.lora.tools.hf import LoraLayer, TokenSlots, attach

ROWS = ["x", None, "y", "z", "x"]


def serve(config, paths, rows, slots_n=3):
    """The engine side: check, load through the store, activate into a pool, attach to a fresh model."""
    specs = specs_from_config(config, max_rank=8)
    nodes = list(specs.values())
    digests = {n: check_adapter_file(nodes[0], n, p, nodes[1:]) for n, p in paths.items()}
    pools = {}
    for node, spec in specs.items():
        store = LoraAdapterStore(spec, pin=False, dtype=torch.float32)
        pool = LoraDevicePool(spec, slots_n, dtype=torch.float32)
        for n in dict.fromkeys(r for r in rows if r):
            pool.activate(store.load(n, paths[n], digests[n]), keep=[r for r in rows if r])
        pools[node] = pool
    model = build_model(config)
    slots = TokenSlots()
    attach(model, pools, slots)
    first = next(iter(pools.values()))
    slots.rows = torch.tensor([first.slot_of(r) if r else -1 for r in rows])
    return model, slots, pools


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_mixed_batch_matches_peft_row_by_row(tmp_path, arch):
    config = model_config(arch)
    extra = {} if arch != "phi3" else {"target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
    paths = {}
    for i, (n, lora) in enumerate({"x": {"r": 4}, "y": {"r": 8, "use_rslora": True},
                                   "z": {"r": 2, "alpha_pattern": {"down_proj": 3}}}.items()):
        paths[n] = make_adapter(tmp_path, arch, name=n, seed=i + 1, **lora, **extra)[1]
    model, _, _ = serve(config, paths, ROWS)
    ids = torch.randint(1, 100, (len(ROWS), 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
    ref = peft.PeftModel.from_pretrained(build_model(config), paths["x"], adapter_name="x")
    for n in ("y", "z"):
        ref.load_adapter(paths[n], adapter_name=n)
    with torch.no_grad():
        want = ref(ids, adapter_names=[r or "__base__" for r in ROWS]).logits
        base = build_model(config)(ids).logits
    for i, r in enumerate(ROWS):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4, msg=f"row {i} ({r})")
        if r:
            assert (got[i] - base[i]).abs().max() > 1e-3, "the adapter changes its row"


def qwen2_vl_inputs(config, rows: int):
    """Each row: a few text tokens and one 4-patch image (one token after the 2x2 merge)."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(1, 100, (rows, 6), generator=g)
    image = torch.tensor([config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]])
    ids = torch.cat([text[:, :3], image.expand(rows, 3), text[:, 3:]], 1)
    v = config["vision_config"]
    pixels = torch.randn(rows * 4, 3 * v["temporal_patch_size"] * v["patch_size"] ** 2, generator=g)
    grid = torch.tensor([[1, 2, 2]] * rows)
    types = (ids == config["image_token_id"]).int()  # text 0, image 1
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": types}


def test_qwen2_vl_mixed_batch_with_vision_tower_matches_peft(tmp_path):
    config = model_config("qwen2_vl")
    rows = ["x", None, "y"]
    paths = {n: make_adapter(tmp_path, "qwen2_vl", name=n, seed=i + 1, target_modules=LM_TARGETS + VISION_MODULES)[1]
             for i, n in enumerate(["x", "y"])}
    model, slots, pools = serve(config, paths, rows)
    inputs = qwen2_vl_inputs(config, len(rows))
    vision = pools["vision_tower"]
    slots.patches = torch.tensor([vision.slot_of(r) if r else -1 for r in rows]).repeat_interleave(4)
    with torch.no_grad():
        got = model(**inputs).logits
        slots.patches = torch.full_like(slots.patches, -1)
        text_only = model(**inputs).logits
    assert isinstance(model.get_submodule("model.visual.patch_embed.proj"), LoraLayer)
    assert all((got[i] - text_only[i]).abs().max() > 1e-4 for i in (0, 2)), "the vision tower's LoRA is applied"
    for i, r in enumerate(rows):
        ref = build_model(config)
        if r:
            ref = peft.PeftModel.from_pretrained(ref, paths[r])
        with torch.no_grad():
            row = {k: v[4 * i : 4 * i + 4] if k == "pixel_values" else v[i : i + 1] for k, v in inputs.items()}
            want = ref(**row).logits
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-4, msg=f"row {i} ({r})")
