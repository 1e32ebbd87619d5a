"""The header cache holds memory, not header bytes: what it keeps is charged what it holds, and a refused
adapter's parse is let go (README, "Header memory")."""

from __future__ import annotations

import gc
import subprocess
import sys
import tracemalloc

import pytest
import torch
from moe import per_expert_adapter, specs
from safetensors.torch import save_file
from tiny import model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file
from mstar.engine.resources.lora import safetensors_header as sh
from mstar.engine.resources.lora.models import specs_from_config

# The README's bound: refusing four headers of 250,000 tensors each, one after another, leaves resident
# memory no more than this above where the first refusal left it.
REFUSED_RSS_MB = 48


def test_a_header_and_what_is_derived_from_it_hold_no_more_than_they_are_charged(tmp_path):
    """A per-expert MoE adapter through the startup check and both nodes' reads: the memory freed when the
    cache lets go of its header is within what the cache charged for it, and not a small part of it."""
    _, path = per_expert_adapter(tmp_path, "qwen3_moe", experts=range(64))
    s = specs("qwen3_moe", num_experts=64)
    sh._HEADERS.clear()
    gc.collect()
    tracemalloc.start()
    try:
        digest = check_adapter_file(s["language_model"], "pe", path, [s["experts"]])
        for node in ("language_model", "experts"):
            store = LoraAdapterStore(s[node], pin=False, dtype=torch.float32)
            store.read("pe", path, digest)
            store.read("pe", path)
            del store
        header = sh.read_header(path / "adapter_model.safetensors")
        charge, tensors = sh.held_bytes(header), len(header.tensors)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        sh.forget(header)
        del header
        gc.collect()
        freed = before - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert tensors == 2 * 64 * 3 * 2
    assert charge / 4 < freed <= charge, (freed, charge)


REFUSALS = r"""
import os, struct, sys
from pathlib import Path
from mstar.engine.resources.lora import check_adapter_file, safetensors_header as sh, specs_from_config
config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}
spec = specs_from_config(config, max_rank=8)["language_model"]
def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
root = Path(sys.argv[1])
out = []
for f in range(4):
    entry = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    body = ",".join(f'"model.layers.{i}.mlp.experts.{f}.gate_proj.w":{entry}' for i in range(250_000))
    text = ("{" + body + "}").encode()
    path = root / f"h{f}.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    try:
        check_adapter_file(spec, "h", path)
    except ValueError as e:
        assert str(e).startswith("adapter 'h'"), str(e)[:300]
    else:
        raise AssertionError("served")
    path.unlink()
    del body, text
    out.append(rss())
print(len(sh._HEADERS), *out)
"""


def test_refused_headers_keep_no_memory(tmp_path):
    """Four files whose headers list 250,000 tensors each (20 MB, under the 262,144 cap) are refused one after
    another, deleted, nothing registered: resident memory stays where the first left it, nothing is cached.
    Run apart, so the figures are this process's alone (about 5 s)."""
    done = subprocess.run([sys.executable, "-c", REFUSALS, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cached, *rss = map(int, done.stdout.split())
    assert cached == 0
    assert rss[-1] - rss[0] <= REFUSED_RSS_MB, rss


def test_a_header_listing_more_tensors_than_the_specs_serve_is_refused_by_its_count(tmp_path):
    """5,000 tensors (past the 4,096 judged module by module) for a model whose specs serve at most 63."""
    file = tmp_path / "many.safetensors"
    save_file({f"model.layers.{i}.self_attn.q_proj.lora_A.weight": torch.zeros(1)
               for i in range(5000)}, file)
    llama = specs_from_config(model_config("llama"), max_rank=8)
    with pytest.raises(ValueError, match=r"adapter 'many' \(.*\): its header lists 5000 tensors, more than the 63 "
                                         r"that language_model can serve"):
        check_adapter_file(llama["language_model"], "many", file)
    assert all(len(h.tensors) != 5000 for h, _ in sh._HEADERS._headers.values()), "a refused header stays cached"
