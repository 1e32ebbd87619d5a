"""mstar-lora demo: the pool as an engine uses it, on a tiny model, checked against PEFT.

LoraManager runs a short trace through a toy engine (continuous batching, a KV cache per request) with
more adapters than the host tier and the device slots hold, so reads, evictions and prefetch happen;
one adapter is reloaded half way (requests admitted before keep its old weights) and one adapter's file
breaks (only its requests fail, naming it). Then PEFT generates every request's tokens again with that
request's adapter version, and each token must be the same.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..manager import LoraManager
from ..registry import Version
from ..resolvers import FolderResolver
from .demo_check import check_against_peft
from .demo_models import MIXTURES, demo_config
from .engine import Engine, Job, StepReport
from .hf import TokenSlots, attach
from .samples import decoder_modules, sample_modules, write_peft_adapter
from .table import size, table

MAX_RANK, HOST_CAPACITY, SLOTS = 16, 4, 3
B_STD = 0.1  # sample adapters strong enough to change what the tiny model generates

# name: (rank, alpha, which targets, which layers, extra config): a spread an engine meets.
SAMPLES = {
    "sql-expert": (16, 32, None, None, {}),
    "support-bot": (8, 16, ("qkv_proj", "o_proj"), None, {}),
    "tiny-r2": (2, 4, None, range(0, 2), {"layers_to_transform": [0, 1]}),
    "rslora": (12, 12, None, None, {"use_rslora": True}),
    "patterned": (8, 8, ("gate_up_proj", "down_proj"), None, {"alpha_pattern": {"down_proj": 32}}),
    "french": (4, 8, ("qkv_proj",), None, {}),
}
TOO_BIG = ("too-big", 32)  # over max_rank: the startup check must refuse it by name
RELOADED, RELOAD_AT = "support-bot", 6  # registered again with new weights before this step
BROKEN, BREAK_AT = "french", 8  # its file truncated before this step, after its copy was evicted
ON_DEMAND = "tiny-r2"  # not registered at startup: the folder resolver finds it when its first request comes

# step: (adapter, prompt length, tokens wanted) of each request arriving then; None is the base model
TRACE = {
    0: [("sql-expert", 6, 8), ("support-bot", 5, 14), (None, 4, 6)],
    1: [("french", 5, 3), ("tiny-r2", 7, 5)],
    2: [("rslora", 4, 6), ("sql-expert", 8, 4)],
    3: [("patterned", 6, 5), ("french", 4, 3)],
    4: [("support-bot", 5, 6), (None, 6, 4)],
    5: [("tiny-r2", 5, 4), ("rslora", 6, 5)],
    6: [("support-bot", 4, 6), ("sql-expert", 5, 5)],
    7: [("patterned", 7, 4), ("support-bot", 6, 5)],
    8: [("rslora", 5, 4), ("tiny-r2", 4, 4)],
    9: [("sql-expert", 6, 3), ("patterned", 5, 4)],
    10: [("french", 5, 4), (None, 4, 3), ("support-bot", 5, 4)],
    11: [("french", 6, 3), ("tiny-r2", 4, 3)],
}


def write_samples(spec, root: Path) -> dict[str, Path]:
    """The sample PEFT adapters, the one over max_rank, and the reloaded adapter's second version."""
    names = decoder_modules(spec)
    paths = {}
    for i, (name, (r, alpha, targets, layers, extra)) in enumerate(SAMPLES.items()):
        targets = [t for t in targets or names if t in names] or None  # a mixture's node has attention alone
        modules = sample_modules(spec, r, seed=i, layers=layers, targets=targets, b_std=B_STD)
        paths[name] = write_peft_adapter(root / name, modules, alpha=alpha, **extra)
    r, alpha, targets, layers, extra = SAMPLES[RELOADED]
    modules = sample_modules(spec, r, seed=100, layers=layers, targets=targets, b_std=B_STD)
    paths[f"{RELOADED} v2"] = write_peft_adapter(root / f"{RELOADED}-v2", modules, alpha=alpha, **extra)
    bad = sample_modules(spec, TOO_BIG[1], seed=99, layers=range(1))
    paths[TOO_BIG[0]] = write_peft_adapter(root / TOO_BIG[0], bad, alpha=64)
    return paths


def startup(manager: LoraManager, paths: dict[str, Path]) -> dict[str, Version]:
    """The startup check over every sample (refusing too-big by name), then the good ones registered."""
    served = {n: p for n, p in paths.items() if n in SAMPLES and n != ON_DEMAND}
    try:
        manager.register_all({**served, TOO_BIG[0]: paths[TOO_BIG[0]]})
    except ValueError as e:
        print(f"startup check: {e}\n")
    versions = manager.register_all(served)
    rows = [{"adapter": n, "rank": SAMPLES[n][0], "targets": ",".join(sorted(SAMPLES[n][2] or ["all"])),
             "layers": "all" if SAMPLES[n][3] is None else f"{SAMPLES[n][3].start}-{SAMPLES[n][3].stop - 1}",
             "options": ", ".join(SAMPLES[n][4]) or "", "host bytes": size(sum(v.nbytes.values())),
             "digest": v.digest.hex()[:16]} for n, v in versions.items()]
    print(table(rows, ["adapter", "rank", "targets", "layers", "options", "host bytes", "digest"]) + "\n")
    return versions


def trace_jobs(vocab: int) -> list[Job]:
    g = torch.Generator().manual_seed(0)
    jobs = []
    for step, arrivals in TRACE.items():
        for adapter, prompt, wants in arrivals:
            ids = torch.randint(1, vocab, (prompt,), generator=g).tolist()
            jobs.append(Job(f"r{len(jobs)}", step, adapter, ids, wants))
    return jobs


def events(manager: LoraManager, paths: dict[str, Path], root: Path,
           folders: dict[bytes, tuple[str, Path]]) -> dict[int, Callable[[], None]]:
    """The reload and the break, each run before its step."""
    def reload() -> None:
        v = manager.register(RELOADED, paths[f"{RELOADED} v2"])
        folders[v.digest] = (RELOADED, paths[f"{RELOADED} v2"])
        print(f"  -- {RELOADED} registered again with new weights (version {v.digest.hex()[:8]}): requests "
              "admitted from now on get them, running ones keep the old")

    def break_file() -> None:
        v = manager.registry.resolve(BROKEN)
        # the weights as checked, for PEFT to check the requests served before the break against
        folders[v.digest] = (BROKEN, shutil.copytree(paths[BROKEN], root / f"{BROKEN}-as-checked", dirs_exist_ok=True))
        weights = paths[BROKEN] / "adapter_model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        copy = manager.stores["language_model"].get(v.key)
        print(f"  -- {BROKEN}'s adapter_model.safetensors truncated to half on disk; its host copy "
              f"{'is still in' if copy is not None else 'was evicted'}")

    return {RELOAD_AT: reload, BREAK_AT: break_file}


LEGEND = ("per step: the requests that arrived, were admitted and failed; how many run and wait after it; host hits\n"
          "and misses (requests met for the first time), reads landed, host evictions, slot copies (one a target);\n"
          "the host tier, least recent first (* read under way, (old) the version before a reload)\n")
COLUMNS = "step  arrived      admitted          failed  run  wait  hits  misses  reads  evicted  copies  host tier"


def step_line(r: StepReport) -> str:
    """One step as a line: requests that arrived, were admitted and failed; how many run and wait; the
    host hits and misses of requests met for the first time, reads landed, host evictions, slot copies;
    and what the host tier holds, least recent first (* a read under way)."""
    def ids(jobs: list[Job]) -> str:
        return " ".join(j.id for j in jobs)

    store = r.manager.stores["language_model"]
    held = []
    for key in store.held():
        name = key.rpartition("@")[0]
        current = r.manager.registry.resolve(name)
        old = "" if isinstance(current, ValueError) or current.key == key else "(old)"
        held.append(name + old + ("" if store.get(key) is not None else "*"))
    return (f"{r.n:>4}  {ids(r.arrived):<11}  {ids(r.started):<16}  {ids(r.failed):<6}  {r.running:>3}  "
            f"{r.waiting:>4}  {r.delta('host_hits'):>4}  {r.delta('host_misses'):>6}  {r.delta('reads'):>5}  "
            f"{r.delta('evictions'):>7}  {r.delta('device_copies'):>6}  {' '.join(held)}")


def story_holds(jobs: list[Job], versions: dict[str, Version], folders: dict[bytes, tuple[str, Path]]) -> bool:
    """The trace's promises: requests of the reloaded adapter got the version current when they were
    admitted, and only the broken adapter's requests failed, each naming it. Prints what failed."""
    ok = True
    new = next(d for d, (n, _) in folders.items() if n == RELOADED and d != versions[RELOADED].digest)
    for j in jobs:
        if j.adapter == RELOADED and j.error is None:
            want = versions[RELOADED].digest if j.admitted_at < RELOAD_AT else new
            if j.digest != want:
                print(f"MISMATCH {j.id} admitted at step {j.admitted_at} got version {j.digest.hex()[:8]}")
                ok = False
    failed = [j for j in jobs if j.error is not None]
    for why in dict.fromkeys(str(j.error) for j in failed):
        print(f"failed {' '.join(j.id for j in failed if str(j.error) == why)}: {why}")
    stray = [j.id for j in failed if j.adapter != BROKEN or repr(BROKEN) not in str(j.error)]
    if stray:
        print(f"MISMATCH requests failed that did not ask for {BROKEN}: {' '.join(stray)}")
    return ok and not stray


def base_factory(raw: dict, device: torch.device) -> Callable[[], torch.nn.Module]:
    """A function giving the tiny model with one set of random weights, as often as asked."""
    import transformers

    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()

    def build() -> torch.nn.Module:
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state)
        return model.to(device).eval()

    return build


def demo(raw: dict, root: Path, device: torch.device) -> bool:
    manager = LoraManager.build(raw, max_rank=MAX_RANK, host_capacity=HOST_CAPACITY, slots=SLOTS, device=device,
                                dtype=torch.float32,  # float32, so that tokens can be compared with PEFT's
                                resolver=FolderResolver(root))  # names not registered: looked for under root
    try:
        spec = manager.stores["language_model"].spec
        paths = write_samples(spec, root)
        print(f"wrote {len(SAMPLES)} sample PEFT adapters, a second version of {RELOADED} and one over max_rank "
              f"{MAX_RANK}; a host tier of {HOST_CAPACITY} adapters and {SLOTS} device slots\n")
        versions = startup(manager, paths)
        print(f"{ON_DEMAND} is not registered: a folder resolver over {root.name}/ finds, checks and reads it off "
              "the step when its first request names it\n")
        folders = {v.digest: (n, paths[n]) for n, v in versions.items()}
        jobs = trace_jobs(raw["vocab_size"])
        per = {n: " ".join(j.id for j in jobs if j.adapter == n) for n in [*SAMPLES, None]}
        print(f"trace: {len(jobs)} requests arriving over steps 0-{max(TRACE)}, each decoded greedily on its own "
              f"KV cache; {RELOADED} reloaded before step {RELOAD_AT}, {BROKEN}'s file broken before step "
              f"{BREAK_AT}\n" + "\n".join(f"  {n or '(base model)':<13} {ids}" for n, ids in per.items()) + "\n")
        make = base_factory(raw, device)
        model = make()
        slots = TokenSlots()
        attach(model, manager.pools, slots)
        print(LEGEND + "\n" + COLUMNS)
        start = time.perf_counter()
        Engine(manager, model, slots, device, lambda r: print(step_line(r))).run(
            jobs, events(manager, paths, root, folders))
        resolved = manager.registry.resolve(ON_DEMAND)
        first = min((j for j in jobs if j.adapter == ON_DEMAND), key=lambda j: j.arrives)
        if not isinstance(resolved, ValueError):
            folders[resolved.digest] = (ON_DEMAND, paths[ON_DEMAND])
            print(f"\n{ON_DEMAND} resolved on first use: its first request {first.id} arrived at step {first.arrives} "
                  f"and was admitted at step {first.admitted_at} (version {resolved.digest.hex()[:8]})")
        c = manager.counters
        print(f"\n{c.reads} reads ({size(c.bytes_read)}, {c.read_failures} failed), {c.evictions} evictions, "
              f"{c.device_copies} slot copies, host hits {c.host_hits} / misses {c.host_misses}; "
              f"{time.perf_counter() - start:.1f} s\n")
        story = story_holds(jobs, versions, folders)
        print("\nchecking every request against PEFT generating with its adapter version:")
        tokens = check_against_peft(jobs, folders, make, device)
        return story and tokens
    finally:
        manager.close()


@contextlib.contextmanager
def workdir(keep: str | None) -> Iterator[Path]:
    """--keep's folder, or a temporary one removed however the demo ends (an error, Ctrl-C, a SIGTERM)."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        with tempfile.TemporaryDirectory(prefix="mstar-lora-demo-") as tmp:
            yield Path(tmp)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(args: argparse.Namespace) -> int:
    try:
        import peft  # noqa: F401
        import transformers
    except ImportError:
        print("mstar-lora demo runs a small transformers model and checks it with PEFT: "
              "pip install 'mstar-lora[demo]'", file=sys.stderr)
        return 2
    try:
        raw, kind = demo_config(args.model)
    except ValueError as e:
        print(f"mstar-lora demo: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"model {args.model} as a tiny {kind} (hidden {raw['hidden_size']}, {raw['num_hidden_layers']} layers, "
          f"{raw['num_attention_heads']} heads / {raw['num_key_value_heads']} KV, vocab {raw['vocab_size']}, random "
          f"weights{'; adapters on attention alone' * (kind in MIXTURES)}); max_rank {MAX_RANK}; device {device}")
    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's matmuls gain nothing from more, and spin on a busy machine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renames, not the demo's concern
        try:
            with workdir(args.keep) as root:
                ok = demo(raw, root, device)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            torch.set_num_threads(threads)
    print("\nevery request's tokens match PEFT generating with its adapter version" if ok else
          "\nMISMATCH: see above")
    return 0 if ok else 1
