"""push(copy=True) keeps what was pushed, for tensors that go on changing; a plain push of them is refused after
an eviction, and the refusal says how to recover."""

from __future__ import annotations

import torch
from managers import one_node, settle
from peft import get_peft_model_state_dict
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.manager import Request


def test_a_copy_at_the_push_is_served_after_the_live_tensors_moved_and_a_plain_push_says_how_to_recover(tmp_path):
    pm, path = make_adapter(tmp_path, seed=3)
    live, config = get_peft_model_state_dict(pm), pm.peft_config["default"]  # views of the live parameters
    m = one_node(capacity=1, slots=1)
    m.push("live", live, config)
    m.push("kept", live, config, copy=True)
    assert settle(m, [], [Request(1, "live")]).admitted == [1]
    with torch.no_grad():  # an optimizer step on the model
        for t in live.values():
            t.add_(0.5)
    step = settle(m, [], [Request(2, "kept")])  # live's copy evicted for kept's, read from the copy
    assert step.admitted == [2]
    spec = m.stores["language_model"].spec
    assert step.digest[2] == check_adapter_file(spec, "kept", path), "the weights as they were at the push"
    pool, ref = m.pools["language_model"], LoraAdapterStore(spec, pin=False).read("ref", path)
    assert all(torch.equal(pool.a[t][step.slot[2]], ref.a[t]) and torch.equal(pool.b[t][step.slot[2]], ref.b[t])
               for t in ref.a)
    step = settle(m, [], [Request(3, "live")])
    why = str(step.failed[3])
    assert "the tensors changed since they were pushed" in why and "push with copy=True" in why and \
        "Push them again" in why
    m.close()
