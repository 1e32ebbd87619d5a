"""A spec locates a module by one regex joining its patterns: the same answer as trying them one by one."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.engine.resources.lora.models import presets, specs_from_config
from mstar.engine.resources.lora.spec import LoraSpec, LoraTarget, PerExpert


def one_by_one(spec: LoraSpec) -> LoraSpec:
    """A copy of spec that tries its patterns one after another, as it would with no joined regex."""
    import dataclasses

    copy = dataclasses.replace(spec)
    copy.__dict__["_joined"] = None
    return copy


def names_like(spec: LoraSpec) -> st.SearchStrategy[str]:
    """Names a pattern of spec could match, with their indices and words varied: digits as models write
    them and as they do not (leading zeros, other scripts), words cut or doubled."""
    words = sorted({w for p, _, _ in spec.patterns for w in re.findall(r"[a-z_]{2,}", p)})
    index = st.sampled_from(["0", "1", "7", "12", "01", "٣", "", "x"])
    part = st.one_of(st.sampled_from(words), index)
    return st.lists(part, min_size=1, max_size=8).map(".".join)


PRESET_SPECS = [(name, node, s) for name in presets()
                for node, s in specs_from_config(name, max_rank=16, max_expert_rank=4).items()]


@pytest.mark.parametrize(("preset", "node", "spec"), PRESET_SPECS, ids=[f"{p}-{n}" for p, n, _ in PRESET_SPECS])
def test_every_presets_patterns_join(preset, node, spec):
    assert spec._joined is not None, "a preset whose patterns do not join is located slowly"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_joined_regex_locates_as_the_patterns_one_by_one(data):
    _, _, spec = data.draw(st.sampled_from(PRESET_SPECS))
    names = data.draw(st.lists(names_like(spec), min_size=1, max_size=20))
    slow = one_by_one(spec)
    assert [spec.locate(n) for n in names] == [slow.locate(n) for n in names]


def test_the_first_pattern_that_matches_wins_with_its_own_groups():
    t = LoraTarget(4, 8, (8, 8), "column")
    spec = LoraSpec({"t": t}, 4, patterns=(
        (r"a\.(?P<layer>\d+)\.x", "t", 0),
        (r"a\.(?P<layer>\d)(?P<expert>\d)\.(x|y)", "t", PerExpert(1, 0)),  # reached only where the first fails
        (r"(?P<layer>.*)", "t", 1),
    ))
    slow = one_by_one(spec)
    for name in ["a.12.x", "a.12.y", "a.3.y", "b", "a.01.x", "a.1", ""]:
        assert spec.locate(name) == slow.locate(name), name
    assert spec.locate("a.12.y") == (("t", 1, 2))


def test_patterns_that_refer_to_their_groups_are_tried_one_by_one():
    t = LoraTarget(4, 8, (8,), "column")
    spec = LoraSpec({"t": t}, 4, patterns=((r"(?P<w>[a-z])\.(?P<layer>\d+)\.(?P=w)", "t", 0), (r"(\w)\1", "t", 0)))
    assert spec._joined is None
    assert spec.locate("q.3.q") == ("t", 3, 0) and spec.locate("q.3.r") is None and spec.locate("zz") == ("t", 0, 0)
