"""A header's check against a JSON parse of it: a per-expert MoE adapter's, and a hostile one's refusal.

Run: .venv/bin/python benchmarks/bench_headers.py
The adapter is bench_experts.py's per-expert Qwen3-30B-A3B-shaped one (37,248 tensors, a 5.3 MB header);
its check is open_checkpoint and adapter_problems over both nodes' specs, a header never seen (the digest
it then hashes is BLAKE3's to measure, bench_startup.py). The hostile file lists 250,000 empty tensors
(20 MB of header, under the 262,144 cap) that nothing maps, and is refused. Each is set beside a parse of
the same header bytes by the standard library's json.loads, as called, and by orjson with the collector
held off, as the header's own parse runs. Medians of 9 interleaved runs.
"""

from __future__ import annotations

import atexit
import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from bench_experts import PRESET, R_EXPERT, R, write
from common import cold, ms, settle_writes, side_by_side

from mstar.engine.resources.lora import check_adapter_file, specs_from_config
from mstar.engine.resources.lora.check import adapter_problems
from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.header_json import no_collection


def hostile(root: Path, tensors: int = 250_000) -> Path:
    entry = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    text = ("{" + ",".join(f'"model.layers.{i}.mlp.experts.0.gate_proj.w":{entry}' for i in range(tensors)) + "}")
    path = root / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode())
    return path


def header_text(file: Path) -> bytes:
    data = file.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")]


def main() -> None:
    root = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, root, True)
    specs = specs_from_config(PRESET, max_rank=R, max_expert_rank=R_EXPERT)
    nodes = [specs["language_model"], specs["experts"]]
    adapter, bad = write(root, False), hostile(root)
    settle_writes()
    text, bad_text = header_text(adapter / "adapter_model.safetensors"), header_text(bad)

    def check():
        with open_checkpoint(adapter, "moe") as ckpt:
            assert not adapter_problems(nodes, ckpt)

    def refuse():
        try:
            check_adapter_file(nodes[0], "bad", bad, nodes[1:])
        except ValueError:
            return
        raise AssertionError("served")

    def quiet(parse, data):  # a parse with the collector held off, as the header's own parse runs
        def run():
            with no_collection():
                return parse(data)
        return run

    t = side_by_side({"check": cold(check), "json": lambda: json.loads(text), "orjson": quiet(orjson.loads, text),
                      "refuse": cold(refuse), "bad json": lambda: json.loads(bad_text),
                      "bad orjson": quiet(orjson.loads, bad_text)}, repeat=9)
    print(f"per-expert MoE adapter (37,248 tensors, header {len(text) / 1e6:.1f} MB): check, cold, {ms(t['check'])}; "
          f"json.loads {ms(t['json'])}, orjson (collector off) {ms(t['orjson'])} -> {t['check'] / t['json']:.2f}x "
          f"json.loads, {t['check'] / t['orjson']:.2f}x orjson (target <= 3x)")
    print(f"hostile header (250,000 tensors, {len(bad_text) / 1e6:.1f} MB): refused in {ms(t['refuse'])}; json.loads "
          f"{ms(t['bad json'])}, orjson (collector off) {ms(t['bad orjson'])} -> "
          f"{t['refuse'] / t['bad json']:.2f}x json.loads, {t['refuse'] / t['bad orjson']:.2f}x orjson")


if __name__ == "__main__":
    main()
