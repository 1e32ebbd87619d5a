"""A fault-injection soak of LoraManager: what is served is what was checked, while files and tensors change.

Run: .venv/bin/python scripts/soak.py [--seconds 180] [--seed 0] [--register-on thread|step] (about 3.5
minutes on 2 cores; not in CI). Its exit code is non-zero on any defect below; its last lines report.

A random trace (arrivals; requests running 1-6 steps) over 12 tiny adapters, host capacity 4, 3 device
slots: evictions, re-reads and slot reuse never stop. One thread publishes new versions of 9 file
adapters (an atomic rename, then register again, as an operator reloads), rewrites their files in place
(whole after a pause, or torn), truncates and deletes them; another pushes new tensors for the other 3
and steps the pushed tensors in place (an optimizer, sometimes undone at once). A damaged adapter is
published again (a new version, or the same one) within --heal-ms, and all are for --calm of every
--storm seconds. After each step, every running request's slot (A, B, ranks, scaling, on every node)
must hold the weights of the digest it was admitted with, as separate stores read them from a pristine
copy. A failed request must carry a ValueError naming its adapter and a reason; one failed while its
adapter was intact all step, or told a registered name is not, is spurious. A step over --step-limit,
or a wait over --wait-limit while the adapter is intact, is a hang. Every exception is counted as a
crash, and the soak runs in a child process, so that a SIGBUS shows as its exit code.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from mstar.engine.resources.lora import LoraAdapterStore, LoraManager, Request
from mstar.engine.resources.lora.check import check_adapter_file, check_adapter_tensors
from mstar.engine.resources.lora.checkpoint import CONFIG, WEIGHTS
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter

MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}
TARGETS = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("qkv_proj", "o_proj"), ("gate_up_proj",))
FILE_FAULTS = {"rename": 4, "rewrite": 1, "torn": 1, "truncate": 1, "delete": 1}
PUSH_FAULTS = {"push": 2, "step": 1, "step-and-undo": 1}
REASONS = {"file changed": "the file changed since", "tensors changed": "the tensors changed since",
           "cut short": "ended early|changed size|past the end|too short", "not registered": "is not registered",
           "file missing": "no adapter_model|no such file"}
BAD = ("wrong weights", "crashes", "hangs", "spurious failures", "failures not naming their adapter and a reason",
       "publishes refused")


@dataclass
class Adapter:
    """One name served: its shape (every version's), its current version (digest, the file's bytes or the
    tensors pushed, config), and since when that version's file or tensors are intact (None: damaged)."""

    name: str
    rank: int
    targets: tuple[str, ...]
    pushed: bool
    intact_since: float | None = None
    digest: bytes = b""
    weights: bytes | dict | None = None
    config: str = ""
    tensors: dict | None = None  # the very tensors given to push, which the optimizer steps in place


@dataclass
class Job:
    """A request of the trace, and the digest it was admitted with."""

    id: int
    adapter: str | None
    arrived: float
    steps: int
    digest: bytes | None = None
    flagged: bool = False


def fingerprint(scaling: torch.Tensor, targets: list[tuple[torch.Tensor, ...]]) -> bytes:
    """A slot's scaling and each target's A, B and ranks, hashed byte for byte: 64 bytes kept per digest, so
    RSS stays the manager's."""
    h = hashlib.blake2b(scaling.numpy().tobytes())
    for t in (t for abr in targets for t in abr):
        h.update(t.contiguous().flatten().view(torch.uint8).numpy())
    return h.digest()


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Soak:
    """The manager under test, the reference stores, the adapters' states and what was counted."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root = args, root
        self.manager = LoraManager.build(MODEL, max_rank=8, host_capacity=args.host, slots=args.slots,
                                         world_size=args.world_size, pin=False, read_workers=2)
        self.refs = {n: LoraAdapterStore(s.spec, s.rank, s.world_size, pin=False, dtype=s.dtype)
                     for n, s in self.manager.stores.items()}
        self.spec = next(iter(self.refs.values())).spec
        names = [f"file{i}" for i in range(9)] + [f"push{i}" for i in range(3)]
        self.adapters = {n: Adapter(n, 4 << i % 2, TARGETS[i % 3], n.startswith("push")) for i, n in enumerate(names)}
        self.expected: dict[bytes, dict[str, bytes]] = {}  # digest -> node -> its slot's fingerprint
        self.count: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.reasons: dict[str, str] = {}
        self.seq, self.t0, self.step_started, self.rss_quarter = 0, time.monotonic(), None, ""
        self.stop, self.done = threading.Event(), threading.Event()  # no more faults; no more steps
        self.faulters: list[threading.Thread] = []
        self.control: queue.Queue = queue.Queue()  # registrations for the step loop to make (--register-on step)
        self.lock, self.versions = threading.Lock(), threading.Lock()  # the reference stores are shared

    def problem(self, kind: str, detail: str) -> None:
        with self.lock:
            self.count[kind] += 1
            if self.count[kind] <= 3:
                print(f"[{kind}] {detail}", flush=True)

    # --- versions: made, their slots' fingerprints known, then registered -------------------------

    def version(self, a: Adapter, read) -> None:
        """A new current version of a (its shapes, other weights), read(reference store, pristine folder)
        giving each node's expected slot."""
        with self.versions:
            self.seq += 1
            src = write_peft_adapter(self.root / "versions" / f"{a.name}-{self.seq}", sample_modules(
                self.spec, a.rank, seed=self.seq, targets=a.targets, b_std=0.1), alpha=2 * a.rank)
            a.config = (src / CONFIG).read_text()
            a.weights = safetensors.torch.load_file(src / WEIGHTS) if a.pushed else (src / WEIGHTS).read_bytes()
            a.digest = check_adapter_tensors(self.spec, a.name, a.weights, json.loads(a.config)) if a.pushed \
                else check_adapter_file(self.spec, a.name, src)
            self.expected[a.digest] = {}
            for node, ref in self.refs.items():
                x, pool = read(ref, src), self.manager.pools[node]
                self.expected[a.digest][node] = fingerprint(torch.tensor(x.scaling, dtype=torch.float32), [
                    (x.a[t], x.b[t], x.ranks[t]) if t in x.a else  # a target the version lacks is all zeros
                    (torch.zeros_like(pool.a[t][0]), torch.zeros_like(pool.b[t][0]), torch.zeros_like(pool.ranks[t][0]))
                    for t in pool.a])
                del x
                ref.trim()
            shutil.rmtree(src)

    def register(self, a: Adapter, call) -> None:
        """call (a register or push of a's current version) made where --register-on says; a is intact from
        its return on."""
        box: list = []
        done = threading.Event()

        def attempt() -> None:
            try:
                box.append(call())
            except Exception as e:
                box.append(e)
            done.set()

        if self.args.register_on == "step" and self.faulters:
            self.control.put(attempt)
            if not done.wait(60):
                return self.problem("hangs", f"the step loop did not register {a.name} within 60 s")
        else:
            attempt()
        if isinstance(box[0], Exception) or box[0].digest != a.digest:
            self.problem("publishes refused", f"{a.name} ({a.digest.hex()[:16]}): {box[0]!r}")
        else:
            a.intact_since = time.monotonic()

    # --- faults: an adapter's come from one thread, and mark it damaged before they change it ----------

    def rename(self, a: Adapter, rng: random.Random, again: bool = False) -> None:
        """A new version published by an atomic rename, then registered; again: the current one's bytes
        (registering a failed name again retries it)."""
        a.intact_since = None
        if not again or a.weights is None:
            self.version(a, lambda ref, src: ref.read(a.name, src, a.digest))
        served = self.root / "served" / a.name
        served.mkdir(parents=True, exist_ok=True)
        if not (served / CONFIG).exists():  # every version's is the same: never rewritten under a read
            (served / CONFIG).write_text(a.config)
        (served / "incoming.tmp").write_bytes(a.weights)
        os.replace(served / "incoming.tmp", served / WEIGHTS)
        self.register(a, lambda: self.manager.register(a.name, served))

    def rewrite(self, a: Adapter, rng: random.Random, torn: bool = False) -> None:
        """Other weights (same shapes) over the file in place: whole, after a pause part way; or torn, a part."""
        a.intact_since = None
        path = self.root / "served" / a.name / WEIGHTS
        data = bytearray(a.weights)
        at = 8 + int.from_bytes(data[:8], "little")  # past the header: the same shapes, other weights
        data[at:] = os.urandom(len(data) - at)
        if path.parent.exists():
            cut = rng.randrange(1, len(data))
            with open(path, "r+b" if path.exists() else "wb") as f:
                f.write(data[:cut])
                if not torn:
                    f.flush()
                    time.sleep(rng.uniform(0, 2e-3))
                    f.write(data[cut:])

    def truncate(self, a: Adapter, rng: random.Random) -> None:
        a.intact_since = None
        path = self.root / "served" / a.name / WEIGHTS
        if path.exists():
            os.truncate(path, rng.randrange(path.stat().st_size))

    def delete(self, a: Adapter, rng: random.Random) -> None:
        a.intact_since = None
        served = self.root / "served" / a.name
        shutil.rmtree(served, ignore_errors=True) if rng.random() < 0.3 else (served / WEIGHTS).unlink(missing_ok=True)

    def push(self, a: Adapter, rng: random.Random, again: bool = False) -> None:
        """New tensors pushed; again: the current version's values, in tensors of their own."""
        a.intact_since = None
        if not again or a.weights is None:
            self.version(a, lambda ref, _: ref.read_tensors(a.name, a.weights, json.loads(a.config), a.digest))
        tensors, config = {k: t.clone() for k, t in a.weights.items()}, json.loads(a.config)
        a.tensors = tensors
        self.register(a, lambda: self.manager.push(a.name, tensors, config))

    def step_tensors(self, a: Adapter, rng: random.Random, undo: bool = False) -> None:
        """An optimizer step on a pushed tensor, in place; undo: put back soon after."""
        a.intact_since = None
        t = a.tensors[rng.choice(sorted(a.tensors))]
        before = t.clone()
        t.mul_(0.9).add_(0.01)
        if undo:
            time.sleep(rng.uniform(0, 2e-3))
            t.copy_(before)

    def faulter(self, names: list[str], faults: dict[str, int], rng: random.Random) -> None:
        ops = {"rename": self.rename, "rewrite": self.rewrite, "torn": lambda a, r: self.rewrite(a, r, torn=True),
               "truncate": self.truncate, "delete": self.delete, "push": self.push, "step": self.step_tensors,
               "step-and-undo": lambda a, r: self.step_tensors(a, r, undo=True)}
        publish = self.push if "push" in faults else self.rename
        damaged: dict[str, float] = {}  # name -> when it is published again
        while not self.stop.is_set() or damaged:
            time.sleep(rng.expovariate(1e3 / self.args.fault_ms))
            now = time.monotonic()
            calm = self.stop.is_set() or (now - self.t0) % (self.args.storm + self.args.calm) > self.args.storm
            try:
                for name in [n for n, t in damaged.items() if t <= now or calm]:
                    del damaged[name]
                    again = rng.random() < 0.5
                    publish(self.adapters[name], rng, again=again)
                    self.faults[f"heal: {'the same' if again else 'a new'} version"] += 1
                if not calm:
                    name, kind = rng.choice(names), rng.choices(list(faults), list(faults.values()))[0]
                    ops[kind](self.adapters[name], rng)
                    self.faults[kind] += 1
                    if ops[kind] != publish:
                        damaged[name] = now + rng.uniform(0, self.args.heal_ms / 1e3)
            except Exception:
                self.problem("crashes", f"a fault on {names}: {traceback.format_exc()}")

    # --- the step loop and its checks ----------------------------------------------------------

    def serve(self, rng: random.Random) -> None:
        """The engine's loop: arrivals, a step, its checks, a forward (asleep, prefetching the queue), a step
        done for every running request. Arrivals stop after --seconds, then the queue drains."""
        waiting: list[Job] = []
        running: dict[int, Job] = {}
        while (arriving := time.monotonic() - self.t0 < self.args.seconds) or waiting or running or any(
                t.is_alive() for t in self.faulters):
            now = time.monotonic()
            if not arriving:
                self.stop.set()  # the faulters publish every damaged adapter again, and end
            if now - self.t0 > self.args.seconds + 60:
                return self.problem("hangs", f"no drain: {len(waiting)} waiting, {len(running)} running")
            if now - self.t0 > self.args.seconds / 4 and not self.rss_quarter:
                self.rss_quarter = f"{rss_mb():.0f} MB"
            for _ in range(3 if arriving else 0):
                if rng.random() < self.args.rate / 3:
                    name = rng.choice([*self.adapters, None])
                    waiting.append(Job(self.count["arrived"], name, now, rng.randint(1, 6)))
                    self.count["arrived"] += 1
            while not self.control.empty():
                self.control.get()()
            intact = {n: a.intact_since for n, a in self.adapters.items()}
            self.step_started = time.monotonic()
            try:
                step = self.manager.step([Request(j.id, j.adapter) for j in running.values()],
                                         [Request(j.id, j.adapter) for j in waiting])
            except Exception:
                self.problem("crashes", f"step: {traceback.format_exc()}")
                running.clear()
                continue
            finally:
                self.count["steps"] += 1
                ms = round((time.monotonic() - self.step_started) * 1e3)
                self.count["longest step, ms"] = max(self.count["longest step, ms"], ms)
                self.step_started = None
            for job in waiting:
                if job.id in step.failed:
                    self.fail(job, step.failed[job.id], intact.get(job.adapter))
                elif job.id in step.admitted:
                    job.digest, running[job.id] = step.digest[job.id], job
                    self.count["admitted" if job.adapter else "admitted to the base model"] += 1
            waiting = [j for j in waiting if j.id not in step.failed and j.id not in running]
            self.check_slots(step, [j for j in running.values() if j.adapter is not None])
            self.check_waits(waiting)
            self.manager.prefetch([Request(j.id, j.adapter) for j in waiting])  # as the forward runs
            time.sleep(1e-3)
            for job in list(running.values()):
                job.steps -= 1
                if job.steps == 0:
                    del running[job.id]

    def check_slots(self, step, running: list[Job]) -> None:
        checked = set()
        for job in running:
            digest, slot = step.digest[job.id], step.slot[job.id]
            if digest != job.digest:
                self.problem("wrong weights", f"request {job.id} ({job.adapter}) moved to {digest.hex()[:16]}")
            if (slot, digest) in checked:
                continue
            checked.add((slot, digest))
            self.count["slot checks"] += 1
            if digest not in self.expected:
                self.problem("wrong weights", f"request {job.id} ({job.adapter}): {digest.hex()} never registered")
                continue
            for node, pool in self.manager.pools.items():
                held = [(pool.a[t][slot], pool.b[t][slot], pool.ranks[t][slot]) for t in pool.a]
                if fingerprint(pool.scaling[slot], held) != self.expected[digest][node]:
                    self.problem("wrong weights", f"request {job.id} ({job.adapter}), slot {slot} of {node}: not "
                                                  f"the weights of {digest.hex()[:16]}")

    def fail(self, job: Job, error: Exception, intact_at_start: float | None) -> None:
        self.count["failed"] += 1
        text = str(error)
        if not isinstance(error, ValueError) or f"adapter {job.adapter!r}" not in text or len(text) < 30:
            self.problem("failures not naming their adapter and a reason", f"request {job.id}: {error!r}")
        intact = intact_at_start is not None and self.adapters[job.adapter].intact_since == intact_at_start
        if intact or "is not registered" in text:  # every name is registered from the start on
            self.problem("spurious failures", f"request {job.id} ({job.adapter}, intact all step: {intact}): {text}")
        wrapped = re.match(r"adapter '[^']*' \(.*?\): (\w+)\(", text)  # the manager's wrapping of a non-ValueError
        kind = f"wrapped {wrapped[1]}" if wrapped else next(
            (k for k, pattern in REASONS.items() if re.search(pattern, text, re.I)), "other")
        self.count[f"failed: {kind}"] += 1
        self.reasons.setdefault(kind, text)

    def check_waits(self, waiting: list[Job]) -> None:
        now = time.monotonic()
        for job in waiting:
            since = self.adapters[job.adapter].intact_since
            if since is not None and now - max(job.arrived, since) > self.args.wait_limit and not job.flagged:
                job.flagged = True
                self.problem("hangs", f"request {job.id} ({job.adapter}) has waited {now - job.arrived:.1f} s, its "
                                      f"adapter intact for {now - since:.1f} s")

    def watchdog(self) -> None:
        flagged = None
        while not self.done.wait(0.5):
            started = self.step_started
            if started is not None and time.monotonic() - started > self.args.step_limit and flagged != started:
                flagged = started
                self.problem("hangs", f"a step has run for over {self.args.step_limit} s; every thread's stack:")
                faulthandler.dump_traceback(all_threads=True)


def resources(soak: Soak) -> tuple[str, int]:
    mapped = sum(s.mapped_bytes for s in soak.manager.stores.values())
    fds = len(os.listdir("/proc/self/fd"))
    return f"RSS {rss_mb():.0f} MB, mapped {mapped / 2**20:.2f} MB, {fds} open fds", fds


def report(soak: Soak, start: str, end: str) -> None:
    c, m = soak.count, soak.manager.counters
    print(f"steps {c['steps']} (longest {c['longest step, ms']} ms); requests {c['arrived']}: admitted "
          f"{c['admitted']} with an adapter, {c['admitted to the base model']} to the base model; failed {c['failed']}")
    print("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.faults.items())))
    print("failed by reason: " + ", ".join(f"{k[8:]} {v}" for k, v in sorted(c.items()) if k.startswith("failed: ")))
    for kind, text in sorted(soak.reasons.items()):
        print(f"  e.g. {kind}: {text[:240]}")
    print(f"manager: {m.reads} reads, {m.read_failures} failed, {m.evictions} evictions, {m.device_copies} device "
          f"copies, host hits {m.host_hits}, misses {m.host_misses}")
    print(f"at start: {start}; at end: {end}; RSS a quarter in: {soak.rss_quarter}; {len(soak.expected)} digests")
    print(f"slot checks {c['slot checks']}; " + "; ".join(f"{k} {c[k]}" for k in BAD))


def child(args: argparse.Namespace) -> int:
    faulthandler.enable()  # a SIGBUS or SIGSEGV prints every thread's stack before the process dies
    torch.set_num_threads(1)
    sys.setswitchinterval(args.switch_interval)
    soak, rng = Soak(args, Path(args.child)), random.Random(args.seed)
    threading.excepthook = lambda h: soak.problem("crashes", f"thread {h.thread.name}: {h.exc_value!r}")
    for a in soak.adapters.values():
        (soak.push if a.pushed else soak.rename)(a, rng)
    start, fds_start = resources(soak)
    for pushed, faults in ((False, FILE_FAULTS), (True, PUSH_FAULTS)):
        names = [a.name for a in soak.adapters.values() if a.pushed == pushed]
        soak.faulters.append(threading.Thread(target=soak.faulter, args=(names, faults, random.Random(rng.random()))))
    soak.t0 = time.monotonic()
    for t in [*soak.faulters, threading.Thread(target=soak.watchdog, daemon=True)]:
        t.start()
    try:
        soak.serve(rng)
    finally:
        soak.stop.set()
        soak.done.set()
        for t in soak.faulters:
            t.join()
    reads = threading.Thread(target=soak.manager.wait_for_reads, daemon=True)
    reads.start()
    reads.join(60)
    if reads.is_alive():
        soak.problem("hangs", "reads still under way 60 s after the last step")
    end, fds_end = resources(soak)
    report(soak, start, end)
    print(f"open fds {fds_start} -> {fds_end}: {'a LEAK' if fds_end > fds_start else 'no leak'}", flush=True)
    if reads.is_alive():
        os._exit(1)  # close would wait for the read
    soak.manager.close()
    return 1 if fds_end > fds_start or any(soak.count[k] for k in BAD) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0, help="how long requests arrive (then the queue drains)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--register-on", choices=("thread", "step"), default="thread",
                    help="where new versions are registered: the fault threads (an operator's), or the step loop")
    ap.add_argument("--host", type=int, default=4, help="host capacity, in adapters (of 12)")
    ap.add_argument("--slots", type=int, default=3, help="device slots")
    ap.add_argument("--world-size", type=int, default=1, help="serve rank 0's shards of this many (no group)")
    ap.add_argument("--rate", type=float, default=0.6, help="arrivals per step")
    ap.add_argument("--fault-ms", type=float, default=30.0, help="mean time between faults, per fault thread")
    ap.add_argument("--heal-ms", type=float, default=300.0, help="the most a damaged adapter waits to be published")
    ap.add_argument("--storm", type=float, default=20.0, help="seconds of faults, ...")
    ap.add_argument("--calm", type=float, default=4.0, help="... then seconds of none, every adapter intact")
    ap.add_argument("--switch-interval", type=float, default=0.005, help="sys.setswitchinterval: smaller switches "
                                                                        "threads more often, widening race windows")
    ap.add_argument("--step-limit", type=float, default=5.0, help="a longer step is a hang")
    ap.add_argument("--wait-limit", type=float, default=3.0, help="a longer wait with the adapter intact is a hang")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the folder a child works in
    args = ap.parse_args()
    if args.child:
        sys.exit(child(args))
    print(f"soak: {' '.join(sys.argv[1:]) or 'the defaults'}", flush=True)
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mstar-soak-") as root:
        rc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", root]).returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else "passed" if rc == 0 else "a defect was found"
    print(f"child exit code {rc} ({how}) after {time.monotonic() - t:.0f} s")
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
