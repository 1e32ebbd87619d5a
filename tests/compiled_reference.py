"""Reading a list of cases (an adapter, the config its specs come from, a world size, a store dtype, a
digest or none, a file or a push) into every node's store on every rank, as whichever mstar is first on
the path reads them: run as a script, it is the reference (the code before the compiled read) answering
in a process of its own; imported, it is this branch's code. Each answer is every copy's bytes, ranks,
scaling and rank, and the check's digest, or a refusal's message, so that two answers compare byte for byte.

Run: python compiled_reference.py CASES.json OUT.pt  (with the reference's src first on PYTHONPATH)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _specs(case: dict) -> dict:
    from mstar.engine.resources.lora import specs_from_config

    return specs_from_config(case["config"], **case.get("spec", {}))


def _copy(adapter) -> dict:
    """What a read gave, as bytes: each target's block (a and b where there is none), ranks, scaling, rank."""
    out = {"rank": adapter.rank, "scaling": adapter.scaling, "digest": adapter.digest}
    for t in sorted(adapter.a):
        out[f"a.{t}"] = adapter.a[t].contiguous().view(torch.uint8).clone()
        out[f"b.{t}"] = adapter.b[t].contiguous().view(torch.uint8).clone()
        out[f"a.{t}.shape"], out[f"b.{t}.shape"] = tuple(adapter.a[t].shape), tuple(adapter.b[t].shape)
    for t in sorted(adapter.blocks):
        out[f"block.{t}"] = adapter.blocks[t].contiguous().view(torch.uint8).clone()
    for t in sorted(adapter.ranks):
        out[f"ranks.{t}"] = adapter.ranks[t].clone()
    return out


def _answer(fn) -> dict:
    try:
        return fn()
    except ValueError as e:
        return {"refused": str(e)}


def _host_bytes(store, path: Path) -> int:
    from mstar.engine.resources.lora.checkpoint import open_checkpoint
    from mstar.engine.resources.lora.plan import host_bytes

    with open_checkpoint(path) as ckpt:
        return host_bytes(ckpt, store.layout)


def read_case(case: dict) -> dict:
    """One case's answers: the check's digest, then per node and rank a read without a digest, one with it,
    and one more with it (which checks fingerprints instead of hashing)."""
    from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file

    specs, path, out = _specs(case), Path(case["path"]), {}
    nodes = list(specs.values())
    push = case.get("push", False)
    file = path / "adapter_model.safetensors" if path.is_dir() else path
    tensors = load_file(file) if push else None
    config = json.loads((path / "adapter_config.json").read_text()) if push and path.is_dir() else None
    if push:
        from mstar.engine.resources.lora.check import check_adapter_tensors

        digest = _answer(lambda: {"digest": check_adapter_tensors(nodes[0], "ad", tensors, config, nodes[1:])})
    else:
        digest = _answer(lambda: {"digest": check_adapter_file(nodes[0], "ad", path, nodes[1:])})
    out["check"] = digest
    dtype = DTYPES[case.get("dtype", "float32")]
    ws = case.get("world_size", 1)
    for node, spec in specs.items():
        for rank in range(ws):
            def store(spec=spec, rank=rank):
                return LoraAdapterStore(spec, rank, ws, pin=False, dtype=dtype)

            def read(s, d):
                if push:
                    return _copy(s.read_tensors("ad", tensors, config, d))
                return _copy(s.read("ad", path, d))

            if not push:  # what a load holds room for, from the header alone, before any check
                out[f"{node}.{rank}.host_bytes"] = _answer(lambda store=store: {"bytes": _host_bytes(store(), path)})
            out[f"{node}.{rank}.plain"] = _answer(lambda store=store: read(store(), None))
            if "digest" in digest:
                verified = _answer(store)
                if isinstance(verified, dict):  # a refusal of the layout itself
                    out[f"{node}.{rank}.digest"] = verified
                    continue
                out[f"{node}.{rank}.digest"] = _answer(lambda s=verified: read(s, digest["digest"]))
                out[f"{node}.{rank}.again"] = _answer(lambda s=verified: read(s, digest["digest"]))
    return out


def read_cases(cases: list[dict]) -> list[dict]:
    return [read_case(c) for c in cases]


if __name__ == "__main__":
    torch.set_num_threads(1)
    from mstar.engine.resources import lora

    answers = read_cases(json.loads(Path(sys.argv[1]).read_text()))
    torch.save({"mstar": lora.__file__, "answers": answers}, sys.argv[2])
