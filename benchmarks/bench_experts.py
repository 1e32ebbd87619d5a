"""Reading a Qwen3-30B-A3B-shaped expert adapter, against a memcpy of its bytes; its host bytes per rank.

Run: .venv/bin/python benchmarks/bench_experts.py
The adapter puts rank 2 on every expert's gate, up and down (128 experts, 48 layers) and rank 16 on q, k, v
and o, in bf16, saved two ways: as transformers 4's per-expert modules (36,864 expert tensors) and as PEFT's
stacked target_parameters factors (one pair per layer and projection). The pool's max_rank is 16 for attention
and 2 for experts. Ratios of medians of 9 interleaved runs, in one run; "warm" is a header seen before, as
after the startup check, and planned on by these stores (the check alone runs on a header never seen, and the
reads' cached one is put back after it). The order of the runs rotates from one round to the next, so none
always runs first after another's memory was let go. With --main SRC (a src folder of main's code, say
/tmp/main-ref/src), main's read runs side by side in the same process, its package copied under another name
(mstar_main), so both read the same file in the same runs. For the per-expert adapter, its check alone
(open_checkpoint and adapter_problems over both nodes, a header never seen, the collector held off as
check_checkpoint holds it; no digest) is set beside json.loads of its header's bytes, as called, in the same
rounds. With --collected each run starts from a heap just collected, outside its time: no run then pays for
collecting another's garbage (without it, whichever run sets off the collector's full pass over the process's
million objects pays for all of it).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import Memcpy, aside, cold, ms, settle_writes

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.check import adapter_problems
from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.layout import SlotLayout
from mstar.engine.resources.lora.plan import host_bytes

PRESET, R, R_EXPERT = "qwen3-30b-a3b", 16, 2
PREFIX = "base_model.model.model.layers"


def write(root: Path, stacked: bool) -> Path:
    from mstar.engine.resources.lora.models import load_config

    c = load_config(PRESET)
    hidden, inter, layers = c["hidden_size"], c["moe_intermediate_size"], c["num_hidden_layers"]
    count = c["num_experts"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {}
    for layer in range(layers):
        for proj, fan_in, fan_out in (("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv),
                                      ("o_proj", q, hidden)):
            key = f"{PREFIX}.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = rand(R, fan_in), rand(fan_out, R)
        experts = f"{PREFIX}.{layer}.mlp.experts"
        if stacked:
            tensors[f"{experts}.base_layer.lora_A.weight"] = rand(R_EXPERT * count, hidden)
            tensors[f"{experts}.base_layer.lora_B.weight"] = rand(2 * inter, R_EXPERT * count)
            tensors[f"{experts}.lora_A.weight"] = rand(R_EXPERT * count, inter)
            tensors[f"{experts}.lora_B.weight"] = rand(hidden, R_EXPERT * count)
            continue
        for e in range(count):
            for proj, fan_in, fan_out in (("gate_proj", hidden, inter), ("up_proj", hidden, inter),
                                          ("down_proj", inter, hidden)):
                key = f"{experts}.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = rand(R_EXPERT, fan_in)
                tensors[f"{key}.lora_B.weight"] = rand(fan_out, R_EXPERT)
    path = root / ("stacked" if stacked else "per-expert")
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "peft_version": "0.21.2",
              "rank_pattern": {"gate_up_proj": R_EXPERT, "down_proj": R_EXPERT, "gate_proj": R_EXPERT,
                               "up_proj": R_EXPERT}}
    if stacked:  # as PEFT saves target_parameters beside target_modules
        config.update(target_modules=attention, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    else:
        config.update(target_modules=[*attention, "gate_proj", "up_proj", "down_proj"])
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def rotated(fns: dict, repeat: int, collected: bool = False) -> dict[str, float]:
    """Each function's median time over at least repeat rounds (whole rotations), each round running them all in
    an order rotated by one; where collected, each run from a heap just collected (outside its time), so that no
    run's garbage is collected in another's time."""
    names, times = list(fns), {k: [] for k in fns}
    for i in range(-(-repeat // len(names)) * len(names)):
        for k in names[i % len(names):] + names[: i % len(names)]:
            if collected:
                gc.collect()
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def header_text(file: Path) -> bytes:
    data = file.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")]


def check_alone(package, open_checkpoint, adapter_problems, specs, path: Path) -> None:
    """A check's header work, cold (package's header cache emptied first, where given): the checkpoint opened,
    every node's inspection with the collector held off, as check_checkpoint holds it (no digest)."""
    from mstar.engine.resources.lora.header_json import no_collection

    if package is not None:
        package.safetensors_header._HEADERS.clear()
    with open_checkpoint(path, "moe") as ckpt, no_collection():
        assert not adapter_problems(specs, ckpt)


def main_package(src: str, root: Path):
    """main's lora package from its src folder, copied under root as mstar_main so it imports beside this one."""
    shutil.copytree(Path(src) / "mstar", root / "mstar_main")
    sys.path.insert(0, str(root))
    return importlib.import_module("mstar_main.engine.resources.lora")


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--main", metavar="SRC", help="main's src folder, read side by side")
    args.add_argument("--collected", action="store_true", help="each run from a heap just collected (gc.collect())")
    args = args.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, root, True)
    specs = specs_from_config(PRESET, max_rank=R, max_expert_rank=R_EXPERT)
    theirs = main_package(args.main, root) if args.main else None
    paths = {"per-expert": write(root, False), "stacked": write(root, True)}
    settle_writes()
    for kind, path in paths.items():
        file = path / "adapter_model.safetensors"
        digest = check_adapter_file(specs["language_model"], kind, path, [specs["experts"]])
        stores = {n: LoraAdapterStore(s, pin=False) for n, s in specs.items()}

        def read(stores=stores, path=path, name=kind):
            return [s.read(name, path) for s in stores.values()]

        fns, main_specs = {}, {}
        if theirs is not None:
            main_specs = theirs.specs_from_config(PRESET, max_rank=R, max_expert_rank=R_EXPERT)
            main_stores = [theirs.LoraAdapterStore(s, pin=False) for s in main_specs.values()]

            def main_cold(stores=main_stores, path=path, name=kind):
                theirs.safetensors_header._HEADERS.clear()
                return [s.read(name, path) for s in stores]

            fns["main cold"] = main_cold

        tensors = load_file(file)
        config = json.loads((path / "adapter_config.json").read_text())

        def push(stores=stores, tensors=tensors, config=config, name=kind):  # as an RL loop syncs it every step
            return [s.read_tensors(name, tensors, config) for s in stores.values()]

        if kind == "per-expert":  # the check alone (open and both nodes' inspection), beside a JSON parse
            nodes = [s.spec for s in stores.values()]
            fns["check"] = aside(functools.partial(check_alone, None, open_checkpoint, adapter_problems, nodes, path))
            fns["json"] = functools.partial(json.loads, header_text(file))
            if theirs is not None:
                opened, problems = (importlib.import_module(f"mstar_main.engine.resources.lora.{m}")
                                    for m in ("checkpoint", "check"))
                fns["main check"] = functools.partial(check_alone, theirs, opened.open_checkpoint,
                                                      problems.adapter_problems, list(main_specs.values()), path)
        t = rotated({"cold": cold(read), **fns, "warm": read, "memcpy": Memcpy(file), "push": push,
                          "clone": lambda tensors=tensors: {k: v.clone() for k, v in tensors.items()}}, repeat=9,
                    collected=args.collected)
        adapters = read()
        layout_bytes = sum(a.nbytes for a in adapters)
        print(f"{kind}: file {file.stat().st_size / 1e6:.0f} MB, {len(open_checkpoint(path).header.tensors)} "
              f"tensors; layout {layout_bytes / 1e6:.0f} MB (experts {adapters[1].nbytes / 1e6:.0f} MB)")
        print(f"  read (both nodes) cold {ms(t['cold'])}, warm {ms(t['warm'])}; memcpy of the file {ms(t['memcpy'])} "
              f"-> {t['cold'] / t['memcpy']:.2f}x cold, {t['warm'] / t['memcpy']:.2f}x warm")
        if "main cold" in t:
            print(f"  main's read cold {ms(t['main cold'])} -> {t['main cold'] / t['memcpy']:.2f}x; this branch's "
                  f"{t['cold'] / t['main cold']:.2f}x main's")
        if "check" in t:
            print(f"  check alone (open, both nodes' inspection), cold, {ms(t['check'])}; json.loads of its header "
                  f"{ms(t['json'])} -> {t['check'] / t['json']:.2f}x (target <= 3x)" + (
                      f"; main's {ms(t['main check'])} -> {t['main check'] / t['json']:.2f}x" if "main check" in t
                      else ""))
        print(f"  pushed from memory (both nodes) {ms(t['push'])}; a clone of every tensor {ms(t['clone'])} -> "
              f"{t['push'] / t['clone']:.2f}x")
        assert digest
    ckpt = open_checkpoint(paths["stacked"])
    for ws in (1, 2, 4, 8):
        per_node = {n: host_bytes(ckpt, SlotLayout(s, 0, ws, s.dtype)) for n, s in specs.items()}
        print(f"host bytes per rank at world size {ws}: experts {per_node['experts'] / 1e6:.1f} MB, attention "
              f"{per_node['language_model'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
