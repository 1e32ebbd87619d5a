"""The manager's registrations: register, push, unregister, check_all, from any thread, and what a resolver
found, each queued as a call (calls.py) and applied at a step, where every rank applies the same ones in the
same order. A mixin of LoraManager, which holds the state it changes: the registry, the versions' entries,
the calls, the resolution and the disk tier.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .calls import SYNC, Applied, Call, Deferred
from .disk_tier import DiskTier, default_tier
from .registry import Version
from .versions import Checked, check_path, check_pushed

if TYPE_CHECKING:
    from .manager import LoraManager


class Registrations:
    """What a manager serves, changed by calls from any thread (see calls.py for how they are agreed)."""

    def register(self: LoraManager, name: str, path: str | os.PathLike[str]) -> Version:
        """name checked at path (or Hub id org/repo[@revision], pinned to its commit here) against every
        node's spec and made current: requests admitted from now on get these weights under their
        digest; running ones keep theirs. Registering a name again with other weights is a reload;
        registering a failed name again retries it. The check runs on the calling thread; the call is
        applied as calls() says. With a process group, a rank that cannot check it makes it refused on
        every rank."""
        return self._call("register", (name,), {name: check_path(self.stores, name, path, disk=self.disk_tier)})[name]

    def push(self: LoraManager, name: str, tensors: Mapping[str, torch.Tensor], config: Any = None, *,
             copy: bool = False) -> Version:
        """register for weights in memory (a trainer's new LoRA weights, say): checked, digested as the
        same weights saved as a file would be, and served as a new version of name, never half-visible.
        The tensors are read, never written; the manager keeps them to read again after an eviction,
        and refuses them if they change meanwhile (push again instead). copy=True keeps a copy of them
        as they are at the push instead (one memcpy of their bytes, and that memory held while the
        version is served): for tensors that go on changing, a live model's parameters under an
        optimizer, say."""
        if copy and isinstance(tensors, Mapping):
            tensors = {k: t.detach().clone() if isinstance(t, torch.Tensor) else t for k, t in tensors.items()}
        return self._call("register", (name,), {name: check_pushed(self.stores, name, tensors, config)})[name]

    def register_all(self: LoraManager, adapters: Mapping[str, str | os.PathLike[str] | Version]) -> dict[str, Version]:
        """The serving config at startup: every adapter checked (on every core), raising naming every
        one that cannot be served, on any rank, before any is registered. A Hub id is resolved once, and
        the commit it names is the one checked and read. A value that is a Version (from check_all) is
        registered as checked, not hashed again."""
        return self._call("register", tuple(sorted(adapters)), self.check_all(adapters))

    def check_all(self: LoraManager, adapters: Mapping[str, str | os.PathLike[str] | Version]) -> dict[str, Checked]:
        """Each adapter checked (on every core), registering none: its Version, or why it cannot be served.
        A deployment that serves the good ones passes those Versions to register_all, which then hashes no
        file again. Each rank's own answer: register_all agrees them."""
        def one(name: str, source: Any) -> Checked:
            return source if isinstance(source, Version) else check_path(self.stores, name, source, hash_threads=1,
                                                                         disk=self.disk_tier)

        if all(isinstance(v, Version) for v in adapters.values()):
            return dict(adapters)
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mstar-lora-check") as pool:
            return dict(zip(adapters, pool.map(one, adapters, adapters.values()), strict=True))

    def unregister(self: LoraManager, name: str) -> None:
        """No new request gets name; its memory is freed once no running request uses it."""
        self._call("unregister", (name,))

    def _call(self: LoraManager, kind: str, names: tuple[str, ...],
              checked: Mapping[str, Checked] | None = None) -> Any:
        """A call queued, then applied, and its outcome (a ValueError raised). Without a process group it is
        applied at once (one thread's calls and steps at a time). With one, a call from the engine thread (see
        _on_engine_thread) is agreed at once, as every rank makes it at the same point of its loop; a call from
        any other thread waits for the next step, which applies it on every rank alike (a call made on some
        ranks only is refused, after agree_within seconds, never a hang). An engine-thread call made while
        another rank steps is Deferred: it stays queued for the next step, and its caller is told so."""
        call = self._calls.put(kind, names, checked)
        if self.group is None:
            while not call.done.done():  # another thread applying meanwhile may have taken it: until it is told
                with self._rounds:
                    self._apply(SYNC)
        elif self._on_engine_thread():
            try:
                with self._rounds:  # every round until it is decided: a close waits for them, on every rank alike
                    while not call.done.done():  # until every rank has made it, or it waited past agree_within
                        self._apply(SYNC)
            except Deferred:
                raise Deferred(
                    f"adapter {', '.join(map(repr, names))}: {kind} was called on the engine thread of rank "
                    f"{dist.get_rank(self.group)} while another rank stepped; it stays queued, and the next step "
                    "applies it where every rank has made it. Make such calls at the same point of every rank's "
                    "loop, or from another thread (which waits for the step)") from None
            except ValueError:
                self._calls.drop(call)  # refused here: never applied later by a round it was not agreed in
                raise
            except Exception as e:  # its round failed (a collective): the call was told why, as a ValueError
                told = call.done.exception() if call.done.done() else None
                if told is None:
                    raise
                raise told from e
        else:
            return self._await(call)
        return call.done.result()

    def _await(self: LoraManager, call: Call) -> Any:
        """call's outcome, from a thread that is not the engine's: the next step's, or, where no round took
        the call in within agree_within seconds (no step came: the caller may be the thread that would
        make it), a refusal saying so, the call applied nowhere."""
        while True:
            try:
                return call.done.result(timeout=self._calls.within)
            except TimeoutError:
                if self._calls.abandon(call):
                    break
        raise ValueError(
            f"adapter {', '.join(map(repr, call.names))}: {call.kind} was queued on rank {dist.get_rank(self.group)} "
            f"and no step took it in within {self._calls.within:g} s (agree_within), so it is not applied anywhere. "
            "A call from a thread other than the one that stepped last waits for the next step: make it from the "
            "thread that steps, or step meanwhile")

    def _on_engine_thread(self: LoraManager) -> bool:
        """Whether this thread is the engine's: the one that made the last step (before any step, the one that
        built the manager), while no step runs on another; none once a manager made with engine_thread=False
        has stepped. An engine that warms up on one thread and then steps on another has its engine thread
        move with its steps."""
        me = threading.get_ident()
        return me == self._engine and self._stepping in (None, me)

    def _apply(self: LoraManager, round_: int) -> None:
        """The calls every rank applies now, applied, in the order every rank applies them, and their callers
        told. Resolutions past their time are failed first, so their failure is in this round."""
        if self._resolution is not None:
            self._resolution.expire()
        applied = self._calls.agree(round_)
        try:
            self._applied(applied)
        except BaseException as e:  # an interrupt part way: no caller is left waiting on a call taken off the queue
            if self.group is not None:  # and this rank may now differ from its peers
                self._calls.fail(e, [c for c, _ in applied])
            else:
                self._calls.interrupted([c for c, _ in applied], e)
            raise

    def _applied(self: LoraManager, applied: list[Applied]) -> None:
        for call, result in applied:
            if call.kind in ("resolve", "forget"):
                self._resolved(call.kind, call.names[0], result)
            elif isinstance(result, ValueError):
                self._calls.settle(call, result)
                continue
            with self._lock:
                if call.kind == "unregister":
                    for name in call.names:
                        self.registry.unregister(name)
                        if self._resolution is not None:
                            self._resolution.overtaken(name)
                elif call.kind == "register":
                    for v in result.values():
                        self._register(v)
                        if self._resolution is not None:
                            self._resolution.overtaken(v.name)
            self._calls.settle(call, result)

    def _resolved(self: LoraManager, kind: str, name: str, result: dict[str, Version] | ValueError) -> None:
        if kind == "forget":
            self._resolution.forget(name)  # type: ignore[union-attr]
            return
        with self._lock:
            ours = name not in self.registry  # registered by a call meanwhile: that one stands, this is not heard
            if ours and not isinstance(result, ValueError):
                self._register(result[name])
        self._resolution.applied(name, result if isinstance(result, ValueError) else None,  # type: ignore[union-attr]
                                 heard=ours)

    def close(self: LoraManager) -> None:
        """Refuse steps and calls made from now on; once a step's round in flight has finished (on a rank
        waiting for a peer that is gone, when the group's own timeout ends it), refuse the calls still queued
        (their callers told why); then wait for reads under way (but the one closing it, if a read does), stop
        the workers, and let go of the process group, so that it goes with destroy_process_group rather than
        whenever the manager is collected (a gloo group destroyed at interpreter exit can abort the process)."""
        why = "the manager was closed"
        self._closed = True  # steps from now on refused at once
        self._calls.closed = self._calls.closed or why  # and calls
        with self._rounds:  # between rounds, never within one: a step's round on another thread finishes first
            self._calls.close(why)
            self.group = self._calls.group = None
        self._workers.shutdown(wait=not getattr(self._on_worker, "yes", False))  # a read closing: not on itself
        if self._resolution is not None:
            self._resolution.close()

    def _refuse_ended(self: LoraManager, what: str) -> None:
        """A step or prefetch refused once the manager is closed, or its group was left out of step."""
        if self._closed:
            raise ValueError(f"{what}: the manager was closed; build a new one to serve again")
        if self._calls.broken is not None:
            raise ValueError(f"{what}: {self._calls.broken}")

    def disk_tier(self: LoraManager) -> DiskTier:
        """Where remote adapters' files are kept on local disk: the one given, else disk_tier.default_tier()."""
        if self._disk_tier is None:
            self._disk_tier = default_tier()
        return self._disk_tier

    def _register(self: LoraManager, version: Version) -> None:
        entry = self._entries.get(version.key)
        if entry is not None:  # the same weights again: a failed read is tried anew, with the version as given now
            entry.version, entry.error = version, None
            entry.registered += 1
        # under the lock a step's collection takes: the entry is never collected as stale before its
        # version is current (a reload registered from another thread than the step's was never read)
        self.registry.register(version)
