"""Pushing an adapter from memory: a trainer's state dict into the host tier, against a copy of its bytes.

Run: .venv/bin/python benchmarks/bench_push.py
The adapter is Llama-3-8B-shaped, rank 32 on all seven linears, bf16 (168 MB), laid out at max_rank
32. Ratios of medians of 11 interleaved runs, in one run: the push (read_tensors, which checks,
shards, lays out and copies, never writing the caller's tensors) against one copy of as many bytes
and against a copy of every tensor; and what the manager adds (the check and the digest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import llama8b_spec, ms, side_by_side, verdict

from mstar.engine.resources.lora import LoraAdapterStore
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.keys import PEFT_PREFIX
from mstar.engine.resources.lora.tools.samples import sample_modules


def main() -> None:
    torch.set_num_threads(1)
    spec = llama8b_spec(max_rank=32)
    tensors = {}
    for name, (a, b) in sample_modules(spec, 32, dtype=torch.bfloat16).items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b
    config = {"r": 32, "lora_alpha": 64}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    store = LoraAdapterStore(spec, pin=False)
    flat_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    flat_dst = torch.zeros_like(flat_src)
    copies = {k: torch.empty_like(v) for k, v in tensors.items()}

    def each() -> None:
        for k, v in tensors.items():
            copies[k].copy_(v)

    t = side_by_side({"push": lambda: store.read_tensors("policy", tensors, config),
                      "memcpy": lambda: flat_dst.copy_(flat_src), "each": each,
                      "check": lambda: check_adapter_tensors(spec, "policy", tensors, config)})
    print(f"adapter: {len(tensors)} tensors, {nbytes / 1e6:.0f} MB (Llama-3-8B shape, r=32, bf16)")
    print(f"push (read_tensors): {ms(t['push'])}; one copy of as many bytes {ms(t['memcpy'])} -> "
          f"{verdict(t['push'] / t['memcpy'], 1.2)}; a copy of every tensor {ms(t['each'])} -> "
          f"{t['push'] / t['each']:.2f}x")
    print(f"the check and digest a push through the manager adds: {ms(t['check'])} "
          f"({t['check'] / t['memcpy']:.2f}x the copy; BLAKE3 over every byte)")


if __name__ == "__main__":
    main()
