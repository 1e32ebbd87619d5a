"""The matcher against re itself, over patterns generated from every construct it follows: repeats bounded
and not, alternatives, classes, anchors, \\b and \\B, and lookarounds (nested too), on names drawn from an
alphabet that makes them bite (dots, digits, word and non-word characters, newlines, empty names)."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.engine.resources.lora.patterns import Matching, fullmatch, peft_match

EXAMPLES = int(os.environ.get("PATTERN_EXAMPLES", 300))  # more, for a longer hunt
NAMES = st.text(alphabet="ab1._\n", max_size=8)
ATOMS = st.sampled_from(["a", "b", "1", "_", r"\.", ".", r"\d", r"\w", r"\W", "[ab]", "[^a]", r"\n", "[a-b1]", "(?:)",
                         r"[\d.]", r"[^\w\n]"])
ANCHORS = st.sampled_from(["^", "$", r"\b", r"\B", r"\A", r"\Z"])


def fixed(children):
    """Patterns of one width, as a lookbehind needs: sequences, bounded exact repeats, same-width alternatives."""
    return st.one_of(
        st.tuples(children, children).map("".join),
        st.tuples(children, st.integers(1, 3)).map(lambda t: f"(?:{t[0]}){{{t[1]}}}"),
        st.tuples(children, ANCHORS).map("".join),
    )


FIXED = st.recursive(ATOMS, fixed, max_leaves=4)


def extend(children):
    return st.one_of(
        st.tuples(children, children).map("".join),
        st.tuples(children, children).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        st.tuples(children, st.sampled_from(["*", "+", "?", "*?", "+?", "??"])).map(lambda t: f"(?:{t[0]}){t[1]}"),
        st.tuples(children, st.integers(0, 3), st.integers(0, 2)).map(
            lambda t: f"(?:{t[0]}){{{t[1]},{t[1] + t[2]}}}"),
        st.tuples(children, st.integers(0, 3)).map(lambda t: f"(?:{t[0]}){{{t[1]}}}"),
        st.tuples(st.sampled_from(["?=", "?!"]), children).map(lambda t: f"({t[0]}{t[1]})"),
        st.tuples(st.sampled_from(["?<=", "?<!"]), FIXED).map(lambda t: f"({t[0]}{t[1]})"),
        st.tuples(children, ANCHORS).map("".join),
        children.map(lambda c: f"({c})"),
    )


PATTERNS = st.recursive(st.one_of(ATOMS, ANCHORS), extend, max_leaves=8)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PATTERNS, st.lists(NAMES, min_size=1, max_size=6))
def test_the_matcher_answers_as_re_does(pattern, names):
    try:
        re.compile(pattern)
    except re.error:  # a lookbehind whose alternatives differ in width, say: refused alike (a ValueError)
        return
    for name in names:
        assert fullmatch(pattern, name) == bool(re.fullmatch(pattern, name)), (pattern, name)
        assert peft_match(pattern, name) == bool(re.match(rf"(.*\.)?({pattern})$", name)), (pattern, name)


@pytest.mark.parametrize(("pattern", "name"), [(r"\B", ""), (r"\b", ""), (r"a*\B", ""), (r"(?:\B)?", ""),
                                               ("q_proj$", "q_proj\n"), ("q_proj", "q_proj\n"), ("(?!x)", ""),
                                               ("q_proj", "a.q_proj\n"), ("q_proj", "a\nb.q_proj"),
                                               (r"a\.q_proj", "x.a.q_proj\n"), ("a.q_proj", "a\nq_proj"),
                                               (r"\d{1,2}", "100"), ("x?", "xx"), (r"(?<=a)b", "b")])
def test_the_cases_re_answers_its_own_way_are_answered_as_re_does(pattern, name):
    """\\B on an empty string (nothing, before Python 3.14), $ before a final newline, in plain keys too."""
    assert fullmatch(pattern, name) == bool(re.fullmatch(pattern, name))
    assert peft_match(pattern, name) == bool(re.match(rf"(.*\.)?({pattern})$", name))


PLAIN_KEYS = st.lists(st.text(alphabet="ab1._", min_size=1, max_size=5), min_size=1, max_size=5)


@settings(max_examples=EXAMPLES, deadline=None)
@given(PLAIN_KEYS, st.lists(PATTERNS, max_size=2), st.lists(NAMES, min_size=1, max_size=6), st.randoms())
def test_the_first_key_peft_takes_is_the_one_taken_with_plain_keys_among_regexes(plain, regexes, names, rnd):
    """Keys made of names alone are found through an index; with regex keys among them, in any order, the
    first key PEFT's rule takes (get_pattern_key's loop) is the one taken, names with newlines too."""
    keys = plain + [k for k in regexes if _valid(rf"(.*\.)?({k})$")]
    rnd.shuffle(keys)
    first = Matching(names).keys(keys, "rank_pattern").first
    for name in names:
        want = next((i for i, k in enumerate(keys) if re.match(rf"(.*\.)?({k})$", name)), None)
        assert first(name) == want, (keys, name)


def _valid(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True
