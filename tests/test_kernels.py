"""add_lora's backends against PEFT, row by row, for mixed batches: the reference and the Triton kernels (on the
CPU under Triton's interpreter, see conftest.py), in float32 and float16, on tiny shapes."""

from __future__ import annotations

import math
from functools import cache

import peft
import pytest
import torch
from moe import CONFIGS, peft_expert_deltas, stacked_adapter
from reference import VISION_MODULES, lora_modules, peft_delta
from tiny import LM_TARGETS, build_model, make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, add_lora, specs_from_config
from mstar.engine.resources.lora.apply import triton_installed
from mstar.engine.resources.lora.batch import LoraBatch
from mstar.engine.resources.lora.tools.hf import TokenSlots, attach

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed (pip install .[triton])")
if triton_installed():
    from mstar.engine.resources.lora import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
# Below max_rank 8, a slice of its own rank (k_proj), a layer's own rank, alphas of their own; one rsLoRA.
ADAPTERS = {
    "x": {"r": 4},
    "y": {"r": 8, "rank_pattern": {"k_proj": 2, "layers.1.mlp.down_proj": 3, "patch_embed.proj": 5},
          "alpha_pattern": {"v_proj": 3, "o_proj": 16}},
    "z": {"r": 2, "use_rslora": True, "lora_alpha": 5},
    "decoy": {"r": 8},  # resident in a slot no token uses
}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@cache
def made(tmp, arch: str, dtype: torch.dtype):
    """PEFT's adapters for a tiny model of arch, made by PEFT in dtype (so the factors are exact in it)."""
    config = model_config(arch)
    targets = LM_TARGETS + VISION_MODULES if arch == "qwen2_vl" else LM_TARGETS
    pms, paths = {}, {}
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        pm, paths[name] = make_adapter(tmp / f"{arch}-{dtype}", arch, name=name, seed=i + 1, dtype=dtype,
                                       target_modules=targets, **lora)
        pms[name] = pm.float()  # PEFT's arithmetic on the factors as stored, without rounding
    return config, pms, paths


def serve(tmp, arch, dtype, rank=0, world_size=1):
    """Every node's pool on DEVICE with every adapter activated; the slot of each adapter (alike in every node)."""
    config, pms, paths = made(tmp, arch, dtype)
    pools = {}
    for node, spec in specs_from_config(config, max_rank=8).items():
        store = LoraAdapterStore(spec, rank, world_size, pin=False, dtype=dtype)
        pool = LoraDevicePool(spec, len(ADAPTERS) + 1, DEVICE, rank, world_size, dtype)
        for name in reversed(ADAPTERS):  # so slots are not in the order of the names
            pool.activate(store.read(name, paths[name]))
        pools[node] = pool
    slot_of = {n: next(iter(pools.values())).slot_of(n) for n in ADAPTERS}
    return pms, pools, slot_of


def mixed(slot_of, tokens: int, g: torch.Generator, runs: bool = False) -> tuple[list, torch.Tensor]:
    """Each token's adapter (None for the base model) and slot: shuffled with repeats for a decode-shaped batch,
    long runs for a prefill-shaped one; never the decoy's."""
    names = ["x", "y", "z", None]
    if runs:  # requests of tens of tokens each, one adapter twice
        cuts = sorted(torch.randperm(tokens - 1, generator=g)[:5].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
        who = [names[i % 4] for i in range(len(lengths))]
        per_token = [n for n, k in zip(who, lengths, strict=True) for _ in range(k)]
    else:
        per_token = [names[i] for i in torch.randint(0, 4, (tokens,), generator=g).tolist()]
        per_token[:4] = names  # every kind of token at least once
        per_token = [per_token[i] for i in torch.randperm(tokens, generator=g).tolist()]
    return per_token, torch.tensor([slot_of[n] if n else -1 for n in per_token], device=DEVICE)


def modules_of(pool, pm, target: str, layer: int) -> dict:
    """PEFT's modules on (target, layer), by the slice they cover (None: every slice)."""
    out = {}
    for module, lora in lora_modules(pm).items():
        loc = pool.spec.locate(module)
        if loc is not None and loc.target == target and loc.layer == layer:
            out[loc.slice] = lora
    return out


def peft_want(pool, pms, per_token, target, layer, x, dtype, slices=None) -> torch.Tensor:
    """Each token's delta from its adapter's PEFT modules (0 for none), slices side by side, cut to this rank's
    shard: for a column target its rows of each slice; a row target's input is already this rank's chunk."""
    t = pool.spec.targets[target]
    covered = list(t.covered(slices))
    shard = t.shard(pool.rank, pool.world_size)
    parts = []
    for s in covered:
        r0, r1 = shard.rows[s]
        full = torch.zeros(len(per_token), t.out_features[s])
        for name in {n for n in per_token if n}:
            mods = modules_of(pool, pms[name], target, layer)
            if s in mods:
                d = peft_delta(mods[s], _unflat(mods[s], x.float()))
            else:  # a module fused in the base model covers every slice
                d = peft_delta(mods[None], _unflat(mods[None], x.float()))
                start = t.module_rows(None)[s]
                d = d[:, start : start + t.out_features[s]]
            rows = torch.tensor([n == name for n in per_token])
            full[rows] = d[rows]
        parts.append(full[:, r0:r1])
    return torch.cat(parts, 1)


def _unflat(lora, x):
    """x as the PEFT module takes it: a conv's flattened patches back in [tokens, c, *kernel]."""
    base = lora.base_layer
    return x.view(len(x), base.in_channels, *base.kernel_size) if isinstance(base, torch.nn.Conv3d) else x


def check(pool, pms, per_token, slots, target, layer, dtype, g, slices=None):
    """Both backends' add_lora onto a random output, less that output, against PEFT; the same slots argument
    (tensor or LoraBatch) for both. A row target's rank sees its chunk of the input, and its partial sum is
    PEFT's delta of the input zero outside that chunk."""
    t = pool.layout.targets[target]
    x = torch.randn(len(per_token), t.target.in_features, generator=g).to(dtype)
    k0, k1 = t.shard.columns
    chunk = torch.zeros_like(x)
    chunk[:, k0:k1] = x[:, k0:k1]
    want = peft_want(pool, pms, per_token, target, layer, chunk, dtype, slices)
    x = x[:, k0:k1]
    base = torch.randn(want.shape, generator=g).to(dtype).to(DEVICE)
    for backend in BACKENDS:
        got = add_lora(base.clone(), x.to(DEVICE), pool, target, layer, slots, slices, backend=backend)
        where = f"{backend} {target} layer {layer} slices {slices}"
        torch.testing.assert_close((got.float() - base.float()).cpu(), want, rtol=TOL[dtype], atol=TOL[dtype],
                                   msg=lambda m, where=where: f"{where}: {m}")


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@DTYPES
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_mixed_batch_gives_peft_delta_row_by_row_with_one_batch_for_every_target(tmp_path_factory, dtype, shape):
    tmp = tmp_path_factory.getbasetemp()
    pms, pools, slot_of = serve(tmp, "llama", dtype)
    pool = pools["language_model"]
    g = torch.Generator().manual_seed(1)
    per_token, slots = mixed(slot_of, 13 if shape == "decode" else 512, g, runs=shape == "prefill")
    batch = LoraBatch.build(slots, pool.slots)  # once, for every layer and target
    assert batch.block_m == (16 if shape == "decode" else 64)
    for target in pool.spec.targets:
        check(pool, pms, per_token, batch, target, 1, dtype, g)
    if shape == "decode" and dtype == torch.float32:  # the first layer, and slices as unfused linears name them
        check(pool, pms, per_token, batch, "down_proj", 0, dtype, g)
        check(pool, pms, per_token, batch, "qkv_proj", 1, dtype, g, slices=1)
        check(pool, pms, per_token, batch, "qkv_proj", 2, dtype, g, slices=(2, 0))


def test_per_token_slots_are_grouped_by_the_op_itself(tmp_path_factory):
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "llama", torch.float32)
    g = torch.Generator().manual_seed(2)
    per_token, slots = mixed(slot_of, 9, g)
    check(pools["language_model"], pms, per_token, slots, "gate_up_proj", 2, torch.float32, g)


def test_world_size_two_shards_give_their_part_of_peft_delta(tmp_path_factory):
    """Rank 1 of 2 (its rows and input columns start past 0): column targets give this rank's rows of each slice,
    row targets the partial sum over this rank's chunk of the input."""
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "qwen2_vl", torch.float32, 1, 2)
    g = torch.Generator().manual_seed(3)
    per_token, slots = mixed(slot_of, 11, g)
    for node, pool in pools.items():
        for target in pool.spec.targets:
            check(pool, pms, per_token, slots, target, 1 if node == "language_model" else 0, torch.float32,
                  torch.Generator().manual_seed(4))


def test_vision_tower_replicated_conv_and_its_blocks(tmp_path_factory):
    dtype = torch.float32
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "qwen2_vl", dtype)
    vision = pools["vision_tower"]
    assert vision.spec.targets["patch_embed"].parallel == "replicated"
    g = torch.Generator().manual_seed(6)
    per_token, slots = mixed(slot_of, 8, g)
    for target in vision.spec.targets:
        check(vision, pms, per_token, slots, target, 0 if vision.spec.targets[target].layers == 1 else 1, dtype, g)


def poison(pool, decoy: int) -> int:
    """NaN in the rows of A and columns of B past each module's rank in every slot, and in every weight of the
    decoy's slot; how many padded rows were poisoned."""
    R, poisoned = pool.spec.max_rank, 0
    for target, t in pool.layout.targets.items():
        a, b, ranks = pool.a[target], pool.b[target], pool.ranks[target]
        for slot in range(pool.slots):
            for layer in range(t.target.layers):
                for s in range(t.target.slices):
                    r = ranks[slot, layer, s].item()
                    a[slot, layer, s * R + r : (s + 1) * R] = float("nan")
                    b[slot, layer, t.b_rows(s), r:] = float("nan")
                    poisoned += R - r
        pool.slabs[target][decoy] = float("nan")
    return poisoned


@DTYPES
def test_padding_past_each_slots_rank_is_never_read(tmp_path_factory, dtype):
    """With the padding and the decoy's slot poisoned the deltas stay exact: neither backend reads past a slot's
    real rank, nor another slot's rows."""
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "llama", dtype)
    pool = pools["language_model"]
    assert poison(pool, slot_of["decoy"]) > 0 and pool.ranks["qkv_proj"][slot_of["y"], 1].tolist() == [8, 2, 8]
    g = torch.Generator().manual_seed(7)
    per_token, slots = mixed(slot_of, 12, g)
    batch = LoraBatch.build(slots, pool.slots)
    for target in ("qkv_proj", "down_proj"):  # slices of their own ranks; a row target
        check(pool, pms, per_token, batch, target, 1, dtype, g)


def test_shrink_computes_each_slots_real_rank_and_no_more(tmp_path_factory):
    """h's columns past a slot's rank are left as they were (here zero), though its A's padding is NaN: the
    padded rows are not multiplied, and the delta from the rest is exact."""
    _, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "llama", torch.float32)
    pool = pools["language_model"]
    poison(pool, slot_of["decoy"])
    g = torch.Generator().manual_seed(11)
    _, slots = mixed(slot_of, 12, g)
    batch = LoraBatch.build(slots, pool.slots)
    x = torch.randn(12, 64, generator=g, device=DEVICE)
    h = kernels.shrink(x, pool, "qkv_proj", 1, batch, (0, 1, 2), kernels.blocks_for(batch, 64),
                       torch.zeros(12, 24, device=DEVICE))
    R = pool.spec.max_rank
    for pos, tok in enumerate(batch.order.tolist()):
        slot = slots[tok].item()
        ranks = pool.ranks["qkv_proj"][slot, 1].tolist() if slot >= 0 else [0, 0, 0]
        for s, r in enumerate(ranks):
            a = pool.a["qkv_proj"][slot, 1, s * R : s * R + r]
            torch.testing.assert_close(h[pos, s * R : s * R + r], x[tok] @ a.T, rtol=1e-5, atol=1e-5)
            assert (h[pos, s * R + r : (s + 1) * R] == 0).all(), f"token {tok} slot {slot} slice {s}: past rank {r}"


def test_split_input_and_small_blocks_give_the_same_delta(tmp_path_factory):
    """Shrink programs summing parts of the input by atomic adds, tiles and blocks smaller than the shapes."""
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "llama", torch.float32)
    pool = pools["language_model"]
    g = torch.Generator().manual_seed(12)
    per_token, slots = mixed(slot_of, 20, g)
    batch = LoraBatch.build(slots, pool.slots, block_m=16)
    for target, k in (("qkv_proj", 64), ("down_proj", 96)):
        x = torch.randn(20, k, generator=g)
        want = peft_want(pool, pms, per_token, target, 0, x, torch.float32)
        got = kernels.add_lora_triton(torch.zeros(want.shape, device=DEVICE), x.to(DEVICE), pool, target, 0, batch,
                                      blocks=kernels.Blocks(k=16, n=16, split_k=3))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=target)


def test_expert_slices_give_peft_delta(tmp_path):
    """An expert's gate and up (slices 2e, 2e + 1) and its down (slice e) of a stacked-experts adapter."""
    pm, path = stacked_adapter(tmp_path, "qwen3_moe", rank_pattern={"gate_up_proj": 4})
    spec = specs_from_config(CONFIGS["qwen3_moe"], max_rank=8, max_expert_rank=4)["experts"]
    pool = LoraDevicePool(spec, 2, DEVICE, dtype=torch.float32)
    slot = pool.activate(LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path))
    gate_up, down = peft_expert_deltas(pm, "qwen3_moe", 1)
    g = torch.Generator().manual_seed(8)
    slots = torch.tensor([slot, -1, slot, slot], device=DEVICE)
    on = (slots >= 0).cpu()[:, None]
    for e in (0, 3):
        for target, slices, w in (("experts_gate_up", (2 * e, 2 * e + 1), gate_up[e]), ("experts_down", e, down[e])):
            x = torch.randn(4, w.shape[1], generator=g)
            for backend in BACKENDS:
                got = add_lora(torch.zeros(4, w.shape[0], device=DEVICE), x.to(DEVICE), pool, target, 1, slots,
                               slices, backend=backend)
                where = f"{backend} {target} expert {e}"
                torch.testing.assert_close(got.cpu(), (x @ w.T) * on, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, where=where: f"{where}: {m}")


def test_a_forward_builds_one_batch_and_matches_peft_row_by_row(tmp_path_factory):
    """A tiny Llama with the kernels in its linears: one LoraBatch serves every layer and target."""
    tmp = tmp_path_factory.getbasetemp()
    _, pools, slot_of = serve(tmp, "llama", torch.float32)
    config, _, paths = made(tmp, "llama", torch.float32)
    rows = ["y", None, "x", "z", "y"]
    model = build_model(config).to(DEVICE)
    slots = TokenSlots()
    attach(model, pools, slots, backend="triton")
    slots.rows = torch.tensor([slot_of[r] if r else -1 for r in rows], device=DEVICE)
    ids = torch.randint(1, 100, (len(rows), 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = model(ids.to(DEVICE)).logits.cpu()
    assert slots.builds == 1, "every layer and target read the one LoraBatch"
    ref = peft.PeftModel.from_pretrained(build_model(config), paths["x"], adapter_name="x")
    for n in ("y", "z"):
        ref.load_adapter(paths[n], adapter_name=n)
    with torch.no_grad():
        want = ref(ids, adapter_names=[r or "__base__" for r in rows]).logits
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4, msg=f"row {i} ({r})")


def test_batch_tiles_cover_each_token_once_in_a_grid_fixed_by_the_token_count():
    g = torch.Generator().manual_seed(10)
    for tokens, slot_count, block_m in [(1, 4, 16), (37, 5, 16), (40, 2, 8), (700, 8, None)]:
        for _ in range(3):
            slots = torch.randint(-1, slot_count, (tokens,), generator=g)
            b = LoraBatch.build(slots, slot_count, block_m)
            m = b.block_m
            assert m == (block_m or (64 if tokens >= 512 else 16))
            assert b.tile_slot.numel() == math.ceil(tokens / m) + min(slot_count, tokens), "no data in the grid"
            seen = torch.zeros(tokens, dtype=torch.long)
            for slot, start, end in zip(b.tile_slot.tolist(), b.tile_start.tolist(), b.tile_end.tolist(), strict=True):
                if slot < 0:
                    continue
                pos = torch.arange(start, min(start + m, end))
                tok = b.order[pos]
                assert (slots[tok] == slot).all()
                seen[tok] += 1
            assert torch.equal(seen, (slots >= 0).long()), "every adapted token in one tile, the rest in none"


def test_slots_outside_the_pool_are_refused():
    with pytest.raises(ValueError, match=r"slots \[-2, 4\] are not -1 or one of this pool's 4 slots"):
        LoraBatch.build(torch.tensor([0, 4, -2, 3]), 4)


def test_an_unknown_backend_and_a_batch_for_a_larger_pool_are_refused_and_no_tokens_is_nothing(tmp_path_factory):
    pool = serve(tmp_path_factory.getbasetemp(), "llama", torch.float32)[1]["language_model"]
    x = torch.zeros(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="backend 'cuda' is not one of"):
        add_lora(torch.zeros(1, 64), x, pool, "o_proj", 0, torch.tensor([0], device=DEVICE), backend="cuda")
    wide = LoraBatch.build(torch.tensor([7], device=DEVICE), 8)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=f"built for 8 slots on {DEVICE}.* a pool of 5 slots"):
            add_lora(torch.zeros(1, 64, device=DEVICE), x, pool, "o_proj", 0, wide, backend=backend)
        empty = torch.zeros(0, 64, device=DEVICE)
        none = LoraBatch.build(torch.zeros(0, dtype=torch.long, device=DEVICE), pool.slots)
        assert add_lora(empty, empty, pool, "o_proj", 0, none, backend=backend).shape == (0, 64)
