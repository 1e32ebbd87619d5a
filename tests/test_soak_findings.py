"""What scripts/soak.py found, each as the smallest interleaving that shows it (each failed before its fix).

The interleavings are made deterministic by running the other thread's call exactly where a thread switch
can land, as test_races.py does for reads.
"""

from __future__ import annotations

import os
import sys
import threading

from managers import one_node
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore
from mstar.engine.resources.lora.manager import LoraManager, Request


def manager(store: type[LoraAdapterStore] = LoraAdapterStore) -> LoraManager:
    return one_node(store_class=store)


def outcome(m: LoraManager, rid: int, name: str) -> tuple[bool, ValueError | None]:
    """Whether a request for name is admitted within a few steps (reads landing between them), and its failure."""
    for _ in range(4):
        step = m.step([], [Request(rid, name)])
        if rid in step.admitted or rid in step.failed:
            return rid in step.admitted, step.failed.get(rid)
        m.wait_for_reads()
    return False, None


def test_a_read_under_way_when_the_fixed_file_is_registered_again_does_not_fail_the_name(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=3)
    weights = path / "adapter_model.safetensors"
    good = weights.read_bytes()
    fixed = threading.Event()

    class FailsJustAfterTheFix(LoraAdapterStore):
        def read(self, *args, **kw):
            try:
                return super().read(*args, **kw)
            finally:
                assert fixed.wait(60)

    m = manager(FailsJustAfterTheFix)
    m.register("x", path)
    os.truncate(weights, len(good) // 2)
    m.step([], [Request(1, "x")])  # its read opens the cut file
    (path / "new.tmp").write_bytes(good)  # the operator fixes it: the same version renamed in, registered again
    os.replace(path / "new.tmp", weights)
    m.register("x", path)
    fixed.set()  # the read fails now, after the registration
    m.wait_for_reads()
    admitted, failed = outcome(m, 2, "x")
    m.close()
    assert admitted, f"the file is intact and registered since, yet: {failed}"


def at_every_line(fn, files: tuple[str, ...], between) -> None:
    """fn() with between() run before each of its lines in files: where another thread's switch can land."""
    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.endswith(files):
            return None

        def local(frame, event, arg):
            if event == "line":
                between()
            return local
        return local

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)


def test_a_reload_from_another_thread_fails_no_request_and_is_read(tmp_path):
    paths = [make_adapter(tmp_path, name=f"v{i}", seed=i)[1] for i in (1, 2)]
    m = manager()
    m.register("x", paths[0])
    steps: list[threading.Thread] = []
    failures = []

    def a_step_lands_here():  # the engine's thread steps here, unless its last step is still blocked
        if steps:
            steps[-1].join(0.05)
        if not steps or not steps[-1].is_alive():
            step = threading.Thread(target=lambda: failures.extend(m.step([], [Request(1, "x")]).failed.values()))
            steps.append(step)
            steps[-1].start()
            steps[-1].join(0.05)

    at_every_line(lambda: m.register("x", paths[1]), ("manager.py", "registry.py"), a_step_lands_here)
    for t in steps:
        t.join()
    admitted, failed = outcome(m, 2, "x")
    m.close()
    assert not failures, f"a request failed during the reload: {failures[0]}"
    assert admitted, f"the new version was never read: {failed}"
