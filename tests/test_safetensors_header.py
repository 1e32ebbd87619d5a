"""The header parser: a hostile file gives a ValueError with its reason, never anything else."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import header_json, header_typed
from mstar.engine.resources.lora.header_entries import _entry, _well_formed
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.safetensors_header import MAX_HEADER_BYTES, Header, parse_header, read_header
from mstar.engine.resources.lora.store import check_adapter_file


def raw_file(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def raw_text(header: str, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header.encode() + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_reads_what_safetensors_writes(tmp_path):
    tensors = {"b": torch.randn(3, 4, dtype=torch.bfloat16), "a": torch.zeros(5), "empty": torch.zeros(0, 3)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    h = read_header(tmp_path / "x.safetensors")
    assert h.metadata == {"format": "pt"}
    for name, t in tensors.items():
        e = h.tensors[name]
        assert e.shape == tuple(t.shape) and e.torch_dtype == t.dtype and e.nbytes == t.nbytes


CORRUPT = {
    "truncated": (lambda: raw_file({"a": entry()}, b"\0" * 8)[:-3], "data ends at byte 8, past the end"),
    "header length past the end": (lambda: struct.pack("<Q", 1000) + b"{}", "runs past the end"),
    "offsets out of range": (lambda: raw_file({"a": entry(offsets=(8, 16))}, b"\0" * 8), "gap of 8 bytes"),
    "offsets overlapping": (lambda: raw_file({"a": entry(), "b": entry(offsets=(4, 12))}, b"\0" * 12),
                            "overlaps tensor"),
    "offsets not matching the shape": (lambda: raw_file({"a": entry(offsets=(0, 4))}, b"\0" * 4), "needs 8"),
    "malformed json": (lambda: struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
    "not an object": (lambda: raw_file([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
    "unknown dtype": (lambda: raw_file({"a": entry(dtype="F7")}, b"\0" * 8), "unknown dtype 'F7'"),
    "negative shape": (lambda: raw_file({"a": entry(shape=(-2,))}, b"\0" * 8), "is not a list of sizes"),
    "boolean shape": (lambda: raw_file({"a": entry(shape=(True,), offsets=(0, 4))}, b"\0" * 4), "list of sizes"),
    "boolean offsets": (lambda: raw_file({"a": entry(shape=(1,), offsets=(False, True))}, b"\0"), "data_offsets"),
    "fractional shape": (lambda: raw_file({"a": entry(shape=(1.0,), offsets=(0, 4))}, b"\0" * 4), "list of sizes"),
    "a boolean size after an int one": (lambda: raw_file({"a": entry(shape=(1,), offsets=(0, 4)),
                                                          "b": entry(shape=(True,), offsets=(4, 8))}, b"\0" * 8),
                                        "list of sizes"),
    "a fractional size after an int one": (lambda: raw_file({"a": entry(shape=(1,), offsets=(0, 4)),
                                                             "b": entry(shape=(1.0,), offsets=(4, 8))}, b"\0" * 8),
                                           "list of sizes"),
    "two negative sizes": (lambda: raw_file({"a": entry(shape=(-1, -2), offsets=(0, 8))}, b"\0" * 8), "list of sizes"),
    "a fourth field": (lambda: raw_file({"a": {**entry(), "x": 1}}, b"\0" * 8), "exactly dtype, shape"),
    # as safetensors writes a header (metadata first, no spaces), which msgspec decodes (an adversary's, issue 28)
    "a comma after the metadata and no tensor": (lambda: raw_text('{"__metadata__":{"k":"v"},}'), "not valid JSON"),
    "a tensor named __metadata__": (lambda: raw_text('{"__metadata__":' + json.dumps(entry(), separators=(",", ":"))
                                                     + "}", b"\0" * 8), "string-to-string"),
    "metadata twice, once a tensor": (lambda: raw_text('{"__metadata__":{"k":"v"},"__metadata__":'
                                                       + json.dumps(entry(), separators=(",", ":")) + "}", b"\0" * 8),
                                      "string-to-string|appears twice"),
    "a size past 64 bits": (lambda: raw_text('{"t":{"dtype":"F16","shape":[0,18446744073709551616],'
                                             '"data_offsets":[0,0]}}'), "list of sizes"),
    "a string among huge sizes": (lambda: raw_text('{"a":{"dtype":"F64","shape":[10000000000000000000,"x"],'
                                                   '"data_offsets":[0,8]}}', b"\0" * 8), "list of sizes"),
    "invalid UTF-8 in a name": (lambda: struct.pack("<Q", 30) + b'{"\xff":' + json.dumps(entry()).encode()[:20]
                                + b"\0" * 8, "not valid JSON"),
    "a boolean offset that spans the size": (lambda: raw_file({"a": entry("U8", (1,), (False, 1))}, b"\0"),
                                             "data_offsets"),
    "a fractional offset that spans the size": (lambda: raw_file({"a": entry(offsets=(0.0, 8))}, b"\0" * 8),
                                                "data_offsets"),
    "oversized header": (lambda: struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "over the 104857600-byte limit"),
    "too short": (lambda: b"\x01\x02", "too short"),
    "trailing bytes": (lambda: raw_file({"a": entry()}, b"\0" * 9), "short of the file's 9 data bytes"),
    "duplicate tensor name": (lambda: raw_text(f'{{"a":{json.dumps(entry())},"a":{json.dumps(entry())}}}',
                                               b"\0" * 8), "appears twice"),
    "bad metadata": (lambda: raw_file({"__metadata__": {"a": 1}}), "string-to-string"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_refuses_corrupt_file_with_its_reason(case):
    """Under every parse: msgspec's typed entries, orjson's checked in one pass, the standard library's."""
    data, reason = CORRUPT[case]
    data = data()
    for parse in (contextlib.nullcontext, orjson_only, standard_library_only):
        with parse(), pytest.raises(ValueError, match=reason):
            parse_header(data, len(data))


@pytest.mark.parametrize("case", ["truncated", "header length past the end", "malformed json", "unknown dtype",
                                  "offsets overlapping", "oversized header"])
def test_check_names_adapter_and_file_for_corrupt_weights(tmp_path, case):
    _, path = make_adapter(tmp_path)
    (path / "adapter_model.safetensors").write_bytes(CORRUPT[case][0]())
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*adapter_model\.safetensors\): bad safetensors file"):
        check_adapter_file(spec, "ad", path)


def test_a_truncated_real_adapter_is_refused(tmp_path):
    _, path = make_adapter(tmp_path)
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    with pytest.raises(ValueError, match="past the end"):
        check_adapter_file(spec, "ad", path)


def test_the_header_read_is_bounded_by_the_file(tmp_path):
    """A header that claims 100 MB in a 20-byte file is refused before anything that size is read."""
    f = tmp_path / "liar.safetensors"
    f.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES) + b"{}" + b" " * 10)
    with pytest.raises(ValueError, match="runs past the end"):
        read_header(f)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_header_or_a_value_error(data):
    with contextlib.suppress(ValueError):
        assert isinstance(parse_header(data, len(data)), Header)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=12,
)
entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "I8", "F8_E4M3", "X"]),
    "shape": st.lists(st.integers(-1, 4), max_size=3),
    "data_offsets": st.lists(st.integers(-1, 40), min_size=0, max_size=3),
})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=4), entries | json_values, max_size=4), st.integers(0, 48))
def test_arbitrary_headers_give_a_header_or_a_value_error(header, data_len):
    data = raw_file(header, b"\0" * data_len)
    try:
        parsed = parse_header(data, len(data))
    except ValueError:
        return
    end = max((e.stop for e in parsed.tensors.values()), default=parsed.data_start)
    assert end == len(data), "an accepted header accounts for every data byte"


@contextlib.contextmanager
def standard_library_only():
    """The header parsed as without the optional msgspec and orjson: the standard library's parse, duplicates
    refused by its hook."""
    saved, header_json.orjson = header_json.orjson, None
    try:
        with orjson_only():
            yield
    finally:
        header_json.orjson = saved


@contextlib.contextmanager
def orjson_only():
    """The header parsed as without the optional msgspec: orjson's parse, its entries checked by type."""
    saved, header_typed.msgspec = header_typed.msgspec, None
    try:
        yield
    finally:
        header_typed.msgspec = saved


def outcome(data: bytes) -> object:
    try:
        h = parse_header(data, len(data))
    except ValueError as e:
        return ("refused", str(e))
    return (h.tensors, h.metadata, h.data_start)


# entries of every kind the one pass could confuse: sizes of ints, bools and floats, shapes of one size and
# dimension count (a 2 x 4 and a 4 x 2), offsets of every type, and whole values of any JSON
sizes = st.integers(-1, 4) | st.booleans() | st.sampled_from([0.0, 1.0, 2.0, 2.5, "2", None])
tricky = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "U8", "X", 1]),
    "shape": st.lists(sizes, max_size=3),
    "data_offsets": st.lists(st.integers(-1, 40) | st.sampled_from([0.0, 8.0, False, True]), min_size=1,
                             max_size=3),
})


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(st.text(max_size=3), tricky | entries | json_values, min_size=1, max_size=6), st.integers(0, 9))
def test_the_one_pass_reads_each_entry_as_its_own_check_does(raw, data_start):
    """The fast pass over every entry gives what _entry gives each entry on its own, or gives up (then _entry
    names the reason); it never accepts what _entry refuses, nor reads one entry as another's shape."""
    fast = _well_formed(raw, data_start)
    try:
        want = {name: _entry(name, value, data_start) for name, value in raw.items()}
    except ValueError:
        assert fast is None
        return
    if fast is not None:
        fast, end = fast
        assert fast == want
        ends = [e.stop - data_start for e in want.values()]
        in_order = [e.start - data_start for e in want.values()] == [0, *ends[:-1]]
        assert end == (ends[-1] if in_order else -1)
        assert [type(d) for e in fast.values() for d in (*e.shape, e.start, e.stop)] == [
            int for e in want.values() for _ in (*e.shape, e.start, e.stop)]


def test_tensors_of_one_size_keep_their_own_shapes():
    """An A of [2, 4] and a B of [4, 2] (a square module's factors at r = 2) are the same size, one dtype."""
    data = raw_file({"a": entry(shape=(2, 4), offsets=(0, 32)), "b": entry(shape=(4, 2), offsets=(32, 64))},
                    b"\0" * 64)
    for parse in (contextlib.nullcontext, orjson_only, standard_library_only):
        with parse():
            h = parse_header(data, len(data))
        assert (h.tensors["a"].shape, h.tensors["b"].shape) == ((2, 4), (4, 2)), parse


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), entries | json_values, max_size=4), st.integers(0, 48))
def test_orjson_and_the_standard_library_read_every_header_alike(header, data_len):
    for data in (raw_file(header, b"\0" * data_len), raw_compact(header, b"\0" * data_len)):
        with standard_library_only():
            slow = outcome(data)
        with orjson_only():
            assert outcome(data) == slow
        assert outcome(data) == slow


def raw_compact(header: dict, data: bytes = b"") -> bytes:
    """A header written as safetensors writes one: no spaces (json.dumps puts one after every , and :)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("tensors", [{"b": torch.zeros(2), "a": torch.zeros(3, dtype=torch.bfloat16)}, {}])
def test_msgspec_reads_what_safetensors_writes_as_the_other_parses_do(tmp_path, tensors):
    """Its metadata first and without spaces, its entries by dtype then name (or none at all)."""
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "note": "a:b,{c}"})
    data = (tmp_path / "x.safetensors").read_bytes()
    text = data[8 : 8 + int.from_bytes(data[:8], "little")]
    assert header_typed.decode(text, ("F32", "BF16")) is not None  # read by msgspec, not handed on
    with standard_library_only():
        slow = outcome(data)
    assert outcome(data) == slow and slow[1] == {"format": "pt", "note": "a:b,{c}"}


E = json.dumps(entry())
TWICE = {
    "a tensor": '{"a":' + E + ',"a":' + E + "}",
    "a tensor with a colon in its name": '{"a:b":' + E + ',"a:b":' + E + "}",
    "an entry's dtype": '{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "the metadata": '{"__metadata__":{"k":"v"},"__metadata__":{"k":"v"},"a":' + E + "}",
    "a metadata key": '{"__metadata__":{"k":"v:w","k":"v"},"a":' + E + "}",
    "a key whose first value is no entry": '{"a":1,"a":' + E + "}",
}


@pytest.mark.parametrize("case", list(TWICE))
def test_a_key_written_twice_is_refused_by_either_parse(case):
    data = raw_text(TWICE[case], b"\0" * 8)
    for parse in (contextlib.nullcontext, orjson_only, standard_library_only):
        with parse(), pytest.raises(ValueError, match="appears twice"):
            parse_header(data, len(data))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), entries | json_values, max_size=4), st.integers(0, 48))
def test_what_safetensors_refuses_is_refused(header, data_len):
    data = raw_file(header, b"\0" * data_len)
    try:
        safetensors.torch.load(data)
    except Exception:  # the library raises its own error types, and Python's
        with pytest.raises(ValueError):
            parse_header(data, len(data))


def test_sizes_of_64_bits_read_alike_by_every_parse():
    """msgspec's bounds stop at 63 bits; a size past them, within the 64 safetensors reads, goes to orjson."""
    data = raw_text('{"__metadata__":{"k":"v"},"t":{"dtype":"F16","shape":[0,9223372036854775808],'
                    '"data_offsets":[0,0]}}')
    with standard_library_only():
        slow = outcome(data)
    assert slow[0]["t"].shape == (0, 2**63)
    with orjson_only():
        assert outcome(data) == slow
    assert outcome(data) == slow
