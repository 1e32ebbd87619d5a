"""A file rewritten in place between the header's parse and the copy of its tensors: a read without a digest
(which cannot tell other bytes of the same size) still refuses a file whose size changed, rather than copying
the new file's bytes at the old header's offsets."""

from __future__ import annotations

import pytest
import torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import store as store_module
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
WEIGHTS = "adapter_model.safetensors"


def test_a_file_grown_in_place_after_its_header_was_read_is_refused(tmp_path, monkeypatch):
    _, path = make_adapter(tmp_path, name="ad", r=4, seed=1)
    _, bigger = make_adapter(tmp_path, name="bigger", r=8, seed=2)
    new = (bigger / WEIGHTS).read_bytes()
    assert len(new) > (path / WEIGHTS).stat().st_size
    checked = store_module.refuse_misfits

    def rewrite_after_the_check(spec, ckpt):  # the header is parsed and checked; the tensors are still to come
        checked(spec, ckpt)
        with open(path / WEIGHTS, "r+b") as f:  # in place: the read's open file sees it
            f.write(new)

    monkeypatch.setattr(store_module, "refuse_misfits", rewrite_after_the_check)
    with pytest.raises(ValueError, match=r"^adapter 'ad' \(.*adapter_model\.safetensors\): the file changed size "
                                         r"since its header was read$"):
        LoraAdapterStore(SPEC, pin=False, dtype=torch.float32).read("ad", path)
