"""mstar-lora demo: sample adapters through the whole pool, and a mixed batch checked against merged weights."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ..checkpoint import open_checkpoint
from ..keys import PEFT_PREFIX
from ..models import load_config, specs_from_config
from ..pool import LoraDevicePool
from ..store import LoraAdapterStore, check_adapter_file
from .hf import TokenSlots, attach
from .samples import sample_modules, write_peft_adapter
from .table import table

MAX_RANK = 16

# name: (rank, alpha, which targets, which layers, extra config): a spread an engine meets.
SAMPLES = {
    "sql-expert": (16, 32, None, None, {}),
    "support-bot": (8, 16, ("qkv_proj", "o_proj"), None, {}),
    "tiny-r2": (2, 4, None, range(0, 2), {}),
    "rslora": (12, 12, None, None, {"use_rslora": True}),
    "patterned": (8, 8, ("gate_up_proj", "down_proj"), None, {"alpha_pattern": {"down_proj": 32}}),
    "french": (4, 8, ("qkv_proj",), None, {}),
}
TOO_BIG = ("too-big", 32)  # over max_rank: the startup check must refuse it by name


def write_samples(spec, root: Path, count: int) -> dict[str, Path]:
    paths = {}
    for i, (name, (r, alpha, targets, layers, extra)) in enumerate(list(SAMPLES.items())[:count]):
        modules = sample_modules(spec, r, seed=i, dtype=torch.bfloat16, layers=layers, targets=targets)
        paths[name] = write_peft_adapter(root / name, modules, alpha=alpha, **extra)
    bad = sample_modules(spec, TOO_BIG[1], seed=99, layers=range(1))
    paths[TOO_BIG[0]] = write_peft_adapter(root / TOO_BIG[0], bad, alpha=64)
    return paths


def merged_reference(model_cls, config, state, path: Path | None, scalings: dict[str, float]) -> torch.nn.Module:
    """The base model with one adapter merged into its weights, W + scaling * B A, straight from the file."""
    model = model_cls(config).eval()
    model.load_state_dict(state)
    if path is None:
        return model
    tensors = load_file(path / "adapter_model.safetensors")
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
                b = tensors[key.replace("lora_A", "lora_B")]
                model.get_submodule(module).weight += scalings[module] * (b.float() @ a.float())
    return model


def startup_check(spec, paths: dict[str, Path]) -> dict[str, bytes]:
    """check_adapter_file on every sample, printed; the digests of those that can be served."""
    rows, digests = [], {}
    for name, path in tqdm(paths.items(), desc="startup check", unit="adapter", disable=None, file=sys.stderr):
        t = time.perf_counter()
        try:
            digests[name] = check_adapter_file(spec, name, path)
            verdict = "ok"
        except ValueError as e:
            verdict = "refused: " + str(e).split(": ", 1)[1]
        rows.append({"adapter": name, "size": f"{open_checkpoint(path).size / 1e3:.0f} KB",
                     "digest": digests.get(name, b"").hex()[:16], "check ms": f"{(time.perf_counter() - t) * 1e3:.2f}",
                     "verdict": verdict})
    print(table(rows, ["adapter", "size", "check ms", "digest", "verdict"]) + "\n")
    return digests


def load_and_activate(spec, paths, digests, batch: list[str | None], device: str) -> LoraDevicePool:
    """The batch's adapters through the store into a device pool, printing what each step moved."""
    store = LoraAdapterStore(spec, pin=device == "cuda", dtype=torch.float32)
    pool = LoraDevicePool(spec, slots=4, device=device, dtype=torch.float32)
    needed = [n for n in batch if n]
    rows = []
    for name in dict.fromkeys(needed):
        t = time.perf_counter()
        adapter = store.load(name, paths[name], digests[name])
        read_ms = (time.perf_counter() - t) * 1e3
        copies, fills, moved = pool.copies, pool.fills, pool.bytes_moved
        t = time.perf_counter()
        slot = pool.activate(adapter, keep=needed)
        if device == "cuda":
            torch.cuda.synchronize()
        rows.append({"adapter": name, "rank": adapter.rank, "scaling": f"{adapter.scaling:g}",
                     "targets": len(adapter.a), "host bytes": adapter.nbytes, "read ms": f"{read_ms:.2f}",
                     "slot": slot, "copies": pool.copies - copies, "fills": pool.fills - fills,
                     "moved": pool.bytes_moved - moved, "activate ms": f"{(time.perf_counter() - t) * 1e3:.2f}"})
    again = pool.copies
    for name in needed:
        pool.activate(store.get(name), keep=needed)
    print(table(rows, ["adapter", "rank", "scaling", "targets", "host bytes", "read ms", "slot", "copies", "fills",
                       "moved", "activate ms"]))
    print(f"store holds {len(store)} adapters, {store.nbytes} bytes; re-activating the resident ones copied "
          f"{pool.copies - again} times\n")
    return pool


def mixed_batch(raw: dict, spec, pool: LoraDevicePool, paths, batch: list[str | None], device: str) -> float:
    """One forward of the batch with the pool's op in a tiny transformers model, each row checked
    against its adapter merged into the base weights; the worst logit difference."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    slots = TokenSlots()
    attach(model, {"language_model": pool}, slots)
    model.to(device)
    ids = torch.randint(1, cfg.vocab_size, (len(batch), 12), generator=torch.Generator().manual_seed(1))
    slots.rows = torch.tensor([pool.slot_of(n) if n else -1 for n in batch], device=device)
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float().cpu()
    print(f"one forward of a {len(batch)}-row batch mixing {len(set(batch) - {None})} adapters and the base model: "
          f"{(time.perf_counter() - t) * 1e3:.1f} ms")
    rows, worst = [], 0.0
    for i, name in enumerate(tqdm(batch, desc="reference", unit="row", disable=None, file=sys.stderr)):
        scalings = open_checkpoint(paths[name]).scalings(spec.convert_keys) if name else {}
        ref = merged_reference(type(model), cfg, state, paths[name] if name else None, scalings)
        with torch.no_grad():
            diff = (logits[i : i + 1] - ref(ids[i : i + 1]).logits.float()).abs().max().item()
        worst = max(worst, diff)
        rows.append({"row": i, "adapter": name or "(base)", "max |logit diff| vs merged weights": f"{diff:.2e}"})
    print(table(rows, ["row", "adapter", "max |logit diff| vs merged weights"]))
    return worst


def demo_batch(served: list[str]) -> list[str | None]:
    """Rows mixing up to three of the served adapters (the first twice) with base-model rows."""
    if not served:
        return [None, None]
    first, *rest = served[:3]
    return [first, None, *rest, first, None]


def run_demo(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("mstar-lora demo runs a small transformers model: pip install transformers", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = load_config(args.model)
    spec = specs_from_config(raw, max_rank=MAX_RANK, capacity=4)["language_model"]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mstar-lora-demo-"))
    print(f"model {args.model}: targets {', '.join(spec.targets)}; max_rank {MAX_RANK}; device {device}")
    paths = write_samples(spec, root, args.adapters)
    print(f"wrote {len(paths)} sample PEFT adapters to {root}\n")
    digests = startup_check(spec, paths)
    batch = demo_batch(list(digests))
    pool = load_and_activate(spec, paths, digests, batch, device)
    worst = mixed_batch(raw, spec, pool, paths, batch, device)
    ok = worst < 1e-3
    verdict = "every row matches" if ok else "MISMATCH:"
    print(f"\n{verdict} its adapter merged into the base weights (worst {worst:.1e})")
    return 0 if ok else 1
