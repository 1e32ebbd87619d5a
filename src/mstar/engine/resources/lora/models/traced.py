"""Where diffusers' own conversion of a LoRA state dict puts each key, found by running it on stand-ins.

A pipeline's lora_state_dict converts a trainer's layout into its own by moving tensors between keys, and
for a fused projection (BFL's qkv) by giving its A to each of q, k, v and chunking its B among them. Run on
stand-ins that remember their key and which rows they are, it says where every key's tensor lands, with no
tensor read: a key whose tensor lands whole under one key is renamed; one whose A goes to siblings whole and
whose B goes to them in equal chunks, in order, is the fused module over them (parent.to_q+to_k+to_v), which
the spec locates as its target's every slice. Anything else the conversion does to a stand-in (arithmetic
on its values, its shape asked) ends the trace: the keys are then read as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..keys import split_key

Part = tuple[int, int]  # chunk i of n of a tensor's rows
# The keys a conversion reads as A and B; diffusers converts only those, and the rest (alphas, DoRA's
# magnitudes, LoHa's factors) go with their module.
FACTORS = (".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight")


class Untraceable(Exception):
    """The conversion did something to a stand-in other than move, chunk or rejoin its rows."""


class Piece:
    """Stands in for a tensor: the key it was read from and which of its rows it holds, in order."""

    def __init__(self, key: str, parts: tuple[Part, ...] = ((0, 1),)) -> None:
        self.key, self.parts = key, parts

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.cat:
            pieces = list(args[0])
            if kwargs.get("dim", args[1] if len(args) > 1 else 0) != 0 or len({p.key for p in pieces}) != 1:
                raise Untraceable(pieces[0].key)
            return Piece(pieces[0].key, tuple(part for p in pieces for part in p.parts))
        if func in (torch.chunk, torch.Tensor.chunk):
            return args[0].chunk(args[1], kwargs.get("dim", args[2] if len(args) > 2 else 0))
        raise Untraceable(next((a.key for a in args if isinstance(a, Piece)), None))

    def chunk(self, n: int, dim: int = 0) -> tuple[Piece, ...]:
        if dim != 0 or self.parts != ((0, 1),):
            raise Untraceable(self.key)
        return tuple(Piece(self.key, ((i, n),)) for i in range(n))

    def __mul__(self, other: Any) -> Piece:
        if other == 1:  # a scale of 1 (no alpha baked in) leaves the values as they are
            return self
        raise Untraceable(self.key)

    __rmul__ = __mul__

    @property
    def shape(self) -> _Shape:
        """A shape that may be read (diffusers reads a factor's rank before it knows it needs it) but not used."""
        return _Shape(self.key)

    def __getattr__(self, name: str) -> Any:  # its values, its size: what a stand-in cannot say
        if name.startswith("__"):
            raise AttributeError(name)
        raise Untraceable(self.__dict__.get("key"))


class _Shape:
    """A stand-in's shape: any of its sizes used in arithmetic ends the trace."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __getitem__(self, i: Any) -> _Size:
        return _Size(self.key)

    def __len__(self) -> int:
        raise Untraceable(self.key)


class _Size:
    def __init__(self, key: str) -> None:
        self.key = key

    def _used(self, *_: Any) -> Any:
        raise Untraceable(self.key)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _used
    __floordiv__ = __rfloordiv__ = __mod__ = __lt__ = __le__ = __gt__ = __ge__ = __index__ = __int__ = _used
    __float__ = __bool__ = _used


def traced_modules(convert: Callable[[dict[str, Piece]], Mapping[str, Any]], keys: Sequence[str],
                   prefix: str) -> dict[str, str] | None:
    """Each key's module as convert (a pipeline's lora_state_dict) lays it out, less prefix ("transformer."):
    renamed, or fused over the siblings it is split among. A module whose tensors the conversion does
    something else to is left out and the conversion run again without it, so it keeps no module here
    (absent) and the rest still do; None where the conversion refuses what it is given."""
    stand_in = {k: Piece(k) for k in keys if k.endswith(FACTORS)}
    for _ in range(len(stand_in) + 1):
        if not stand_in:
            return None
        try:
            out = convert(dict(stand_in))
            break
        except Untraceable as e:
            module = split_key(e.args[0])[0] if e.args and isinstance(e.args[0], str) else None
            if module is None:
                return None
            stand_in = {k: v for k, v in stand_in.items() if split_key(k)[0] != module}
        except Exception:  # the conversion's own refusal of what it was given: the keys are read as they are
            return None
    else:
        return None
    landed: dict[str, list[tuple[str, tuple[Part, ...]]]] = {}
    for key, piece in out.items():
        if isinstance(piece, Piece) and key.startswith(prefix):
            landed.setdefault(piece.key, []).append((split_key(key.removeprefix(prefix))[0], piece.parts))
    modules = {}
    for key, places in landed.items():
        module = _module(places, key.endswith((".lora_B.weight", ".lora_up.weight")))
        if module is not None:
            modules[key] = module
    return _whole_modules(modules, stand_in)


def _module(places: list[tuple[str, tuple[Part, ...]]], is_b: bool) -> str | None:
    if len(places) == 1 and places[0][1] == ((0, 1),):
        return places[0][0]
    names = [m for m, _ in places]
    parents = {m.rpartition(".")[0] for m in names}
    n = len(places)
    whole = all(parts == ((0, 1),) for _, parts in places)
    chunked = all(parts == ((i, n),) for i, (_, parts) in enumerate(places))
    if len(parents) != 1 or not (chunked if is_b else whole):
        return None
    return parents.pop() + "." + "+".join(m.rpartition(".")[2] for m in names)


def _whole_modules(modules: dict[str, str], keys: Mapping[str, Piece]) -> dict[str, str]:
    """modules, keeping only modules whose A and B both landed alike (one key of a pair traced and the other
    not is no module)."""
    by_source: dict[str, set[str | None]] = {}
    for key in keys:
        by_source.setdefault(split_key(key)[0], set()).add(modules.get(key))
    return {k: m for k, m in modules.items() if by_source[split_key(k)[0]] == {m}}
