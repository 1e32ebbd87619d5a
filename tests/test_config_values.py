"""Ranks a config gives that no module can have: r, or a rank_pattern value, of 0 is refused by the check
naming the field, in a file and pushed alike (a scaling alpha / 0 has no value)."""

from __future__ import annotations

import json
import re

import pytest
from peft.utils import get_peft_model_state_dict
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import check_adapter_file

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
# r 0 with every module's rank given by rank_pattern: PEFT would build it, but the adapter's own scaling
# (lora_alpha / r, which mstar-lora inspect shows) has no value.
ZEROS = {"r": ({"r": 0, "rank_pattern": {".*_proj": 4}}, "r 0 is not a positive integer"),
         "rank_pattern": ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj'] 0 is not a positive integer")}


@pytest.mark.parametrize("field", list(ZEROS))
def test_a_rank_of_0_in_the_config_is_refused_naming_it(tmp_path, field):
    pm, path = make_adapter(tmp_path)
    over, why = ZEROS[field]
    config = path / "adapter_config.json"
    raw = {**json.loads(config.read_text()), **over}
    config.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"^adapter 'ad' \({re.escape(str(config))}\): .*{re.escape(why)}"):
        check_adapter_file(SPEC, "ad", path)
    with pytest.raises(ValueError, match=rf"^adapter 'ad' \(<pushed tensors>\): .*{re.escape(why)}"):
        check_adapter_tensors(SPEC, "ad", get_peft_model_state_dict(pm), raw)
