"""Where a read's bytes lie: every block and every b at a multiple of layout.ALIGN from the first block (in the
host buffer and in a device slot alike), and the bytes read straight from the file at the address the file has
them at modulo plan.SKEW, where the kernel copies at memory speed."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from reference import assert_serves_peft
from safetensors_files import data_start, header, load, metadata, write_by_hand
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.copies import Staged
from mstar.engine.resources.lora.layout import ALIGN
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.plan import SKEW, plan
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.reader import typed
from mstar.engine.resources.lora.safetensors_header import TensorEntry
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

WEIGHTS = "adapter_model.safetensors"
DTYPES = [torch.float32, torch.bfloat16]


def spec(max_rank: int):
    return specs_from_config(model_config("llama"), max_rank=max_rank)["language_model"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2)], ids=["whole", "rank-1-of-2"])
def test_at_a_max_rank_of_5_every_block_and_b_starts_at_the_alignment(tmp_path, dtype, rank, world_size):
    """At max_rank 8 every a of the tiny model is a multiple of ALIGN long already; at 5 none is."""
    s = spec(5)
    pm, path = make_adapter(tmp_path, r=4, dtype=dtype)
    adapter = LoraAdapterStore(s, rank, world_size, pin=False, dtype=dtype).read("ad", path)
    assert any(a.nbytes % ALIGN for a in adapter.a.values()), "the premise: some a ends off the alignment"
    first = min(block.data_ptr() for block in adapter.blocks.values())
    for t in s.targets:
        assert (adapter.blocks[t].data_ptr() - first) % ALIGN == 0, f"{t}'s block"
        assert adapter.a[t].data_ptr() == adapter.blocks[t].data_ptr(), f"{t}'s a starts its block"
        assert (adapter.b[t].data_ptr() - first) % ALIGN == 0, f"{t}'s b"
    pool = LoraDevicePool(s, slots=3, rank=rank, world_size=world_size, dtype=dtype)
    assert pool.activate(adapter) == 0
    slot = pool.activate(LoraAdapterStore(s, rank, world_size, pin=False, dtype=dtype).read("ad2", path))
    for t, slab in pool.slabs.items():
        for k in (0, slot):
            assert (pool.a[t][k].data_ptr() - slab.data_ptr()) % ALIGN == 0, f"{t}, slot {k}'s a"
            assert (pool.b[t][k].data_ptr() - slab.data_ptr()) % ALIGN == 0, f"{t}, slot {k}'s b"
        assert torch.equal(pool.b[t][0], adapter.b[t])
    if world_size == 1:
        assert_serves_peft(pm.float(), adapter, s, tol=1e-5 if dtype == torch.float32 else 1e-2)


def resave_starting_at(path, residue: int) -> int:
    """The adapter's file saved again, its tensors' bytes starting at residue modulo SKEW (a longer metadata
    entry moves them); the file offset of its first tensor byte."""
    file = path / WEIGHTS
    tensors, meta = load(file), metadata(file)
    for n in range(2 * SKEW):
        blob = safetensors.torch.save(tensors, {**meta, "padding": "x" * n})
        if data_start(blob) % SKEW == residue:
            file.write_bytes(blob)
            return data_start(blob)
    raise AssertionError(f"no metadata length puts the tensors at {residue} modulo {SKEW}")


def file_offsets(path) -> dict[str, int]:
    entries = header(path / WEIGHTS)
    entries.pop("__metadata__")
    start = data_start((path / WEIGHTS).read_bytes()[:8])
    return {k.removeprefix("base_model.model."): start + e["data_offsets"][0] for k, e in entries.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_factors_read_straight_from_the_file_land_at_its_address_modulo_skew(tmp_path, dtype):
    """Rank 8 at max_rank 8 in the store's own dtype: every factor is read straight into its place. Its tensors'
    sizes are multiples of SKEW, so one offset of the blocks puts all of them at the file's alignment."""
    s = spec(8)
    _, path = make_adapter(tmp_path, r=8, dtype=dtype)
    store = LoraAdapterStore(s, pin=False, dtype=dtype)
    for residue in range(0, SKEW, 8):  # safetensors pads its header to 8 bytes
        start = resave_starting_at(path, residue)
        offsets = file_offsets(path)
        assert all((at - start) % SKEW == 0 for at in offsets.values()), "the premise: one alignment for all"
        adapter = store.read("ad", path)
        for key, at in offsets.items():
            module, role = key.removesuffix(".weight").rsplit(".", 1)
            target, layer, sl = s.locate(module)
            sl = 0 if sl is None else sl  # a target of one slice
            tl = store.layout.targets[target]
            view = adapter.a[target][layer, tl.a_rows(sl)] if role == "lora_A" else \
                adapter.b[target][layer, tl.b_rows(sl)]
            assert view.data_ptr() % SKEW == at % SKEW, f"{key} at {at} of the file, residue {residue}"
        del adapter


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_tensors_lying_off_their_dtypes_alignment_in_the_file_serve_what_aligned_ones_do(tmp_path, dtype):
    """A header of any length is valid safetensors; one of odd length puts every tensor at an odd offset."""
    s = spec(8)
    _, path = make_adapter(tmp_path, r=4, dtype=dtype, rank_pattern={"down_proj": 8})  # staged and direct reads
    want = {d: LoraAdapterStore(s, pin=False, dtype=d).read("ad", path) for d in DTYPES}
    file = path / WEIGHTS
    tensors, meta = load(file), metadata(file)
    for mod_8 in (1, 2, 6):
        write_by_hand(file, sorted(tensors.items()), meta, header_length_mod_8=mod_8)
        assert data_start(file.read_bytes()[:8]) % 8 == (8 + mod_8) % 8
        digest = check_adapter_file(s, "ad", path)
        for store_dtype, expected in want.items():
            for got in (LoraAdapterStore(s, pin=False, dtype=store_dtype).read("ad", path, d) for d in (None, digest)):
                for t in expected.a:
                    assert torch.equal(got.a[t], expected.a[t]) and torch.equal(got.b[t], expected.b[t]), t


def staged_places(store: LoraAdapterStore, path) -> list[tuple[int, int, torch.dtype]]:
    """(file offset, staging offset, dtype) of every tensor byte the store's plan for path stages: staged reads,
    dense targets' B and tensors staged whole."""
    with open_checkpoint(path) as ckpt:
        p = plan(ckpt, store.layout)
    places = [(r.at, r.to, r.piece.entry.torch_dtype) for r in p.staged]
    places += [(e.start, at, e.torch_dtype) for e, at in p.whole]
    for d in p.dense:  # its first B row: where the dense copy views the buffer from
        first = min((r for r in p.staged if r.piece.role == "B" and r.piece.target == d.target), key=lambda r: r.to)
        places.append((first.at - (first.to - d.at), d.at, d.dtype))
    return places


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_staged_bytes_lie_at_the_files_address_modulo_skew_or_else_at_their_dtypes_alignment(tmp_path, dtype):
    """Staged bytes are viewed as their dtype where they lie: where the file has them at an offset of that
    alignment they agree with it modulo SKEW (a copy at memory speed), else they are put at the dtype's own
    alignment (no copy of each tensor before it is viewed)."""
    s = spec(8)
    _, path = make_adapter(tmp_path, r=4, dtype=dtype, rank_pattern={"down_proj": 8})
    store = LoraAdapterStore(s, pin=False)  # bfloat16: fp32 factors are staged and cast
    file = path / WEIGHTS
    tensors, meta = load(file), metadata(file)
    for mod_8 in (0, 1, 2, 4, 6):
        write_by_hand(file, sorted(tensors.items()), meta, header_length_mod_8=mod_8)
        places = staged_places(store, path)
        assert places, "the premise: some bytes are staged"
        aligned = [(at, to) for at, to, dt in places if at % dt.itemsize == 0]
        assert all((to - at) % SKEW == 0 for at, to in aligned), f"header length {mod_8} modulo 8"
        assert all(to % dt.itemsize == 0 for _, to, dt in places), f"header length {mod_8} modulo 8"
        if mod_8 % dtype.itemsize:
            assert len(aligned) < len(places), "the premise: some staged bytes lie off their alignment in the file"


def test_a_tensor_at_an_address_off_its_dtypes_alignment_is_read_as_its_values():
    """reader.typed views bytes as their dtype; where they lie at an odd address it reads a copy."""
    values = torch.randn(3, 5, dtype=torch.float32)
    for at in range(4):
        buf = torch.zeros(values.nbytes + 8, dtype=torch.uint8)
        buf[at : at + values.nbytes] = values.view(-1).view(torch.uint8)
        entry = TensorEntry("F32", (3, 5), 0, values.nbytes)
        assert torch.equal(typed(buf, Staged(at, entry.nbytes, entry.torch_dtype, entry.shape)), values), at
