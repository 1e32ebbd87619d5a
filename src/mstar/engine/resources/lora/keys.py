"""Checkpoint keys to (module, role): the suffixes trainers write, and the PEFT layout's conversion."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from operator import eq, itemgetter
from typing import Any, NamedTuple

PEFT_PREFIX = "base_model.model."

# Suffixes written after a module name, and the role each gives, longest match first. Only A, B
# and alpha are served; the other roles are named so a refusal can say what the weight is.
SUFFIXES = (
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".lora_A.default.weight", "A"),  # DiffSynth-Studio saves PEFT's adapter name in its keys
    (".lora_B.default.weight", "B"),
    (".lora_down.weight", "A"),
    (".lora_up.weight", "B"),
    (".alpha", "alpha"),
    (".lora_B.bias", "lora_bias"),
    (".lora_A.bias", "lora_bias"),
    (".lora_magnitude_vector.weight", "dora"),
    (".lora_magnitude_vector", "dora"),
    (".dora_scale", "dora"),
    (".lora_embedding_A", "embedding"),
    (".lora_embedding_B", "embedding"),
    (".token_adapter.trainable_tokens_delta", "tokens"),
    (".lora_mid.weight", "tucker"),
    (".hada_w1_a", "loha"), (".hada_w1_b", "loha"), (".hada_w2_a", "loha"), (".hada_w2_b", "loha"),
    (".hada_t1", "loha"), (".hada_t2", "loha"),
    (".lokr_w1", "lokr"), (".lokr_w2", "lokr"), (".lokr_w1_a", "lokr"), (".lokr_w1_b", "lokr"),
    (".lokr_w2_a", "lokr"), (".lokr_w2_b", "lokr"), (".lokr_t2", "lokr"),
    (".diff_b", "diff"),
    (".diff", "diff"),
    (".bias", "bias"),
    (".weight", "weight"),
)
_BY_LENGTH = sorted(SUFFIXES, key=lambda s: -len(s[0]))

SERVED_ROLES = ("A", "B", "alpha")
# A key conversion: a checkpoint's whole key list read into (module, role) per key.
ConvertKeys = Callable[[Sequence[str]], Mapping[str, tuple[str, str]]]
ROLE_REASONS = {
    "lora_bias": "a LoRA bias (lora_bias, or a trainer's diff_b) is not served",
    "dora": "a DoRA magnitude (dora_scale / lora_magnitude_vector): DoRA is not served",
    "embedding": "LoRA on an embedding is not served",
    "tokens": "trainable token rows are not served",
    "tucker": "a Tucker core (lora_mid, LoCon's conv decomposition) is not plain LoRA",
    "loha": "LoHa (hada_*) is a Hadamard product of two low-rank pairs, not LoRA",
    "lokr": "LoKr (lokr_*) is a Kronecker product, not LoRA",
    "diff": "a full weight delta (.diff / .diff_b) is not a low-rank adapter",
    "bias": "a trained bias is not served",
    "weight": "a whole weight (modules_to_save) is not served",
    "unknown": "not a LoRA weight this pool knows",
    "text_encoder": "a text encoder's LoRA (lora_te1_ / lora_te2_ / text_encoder.*), and no text-encoder node is "
                    "served (give the pipeline's folder, which has its text encoders, or drop them)",
}


_LONGEST = len(_BY_LENGTH[0][0])


def split_key(name: str) -> tuple[str, str]:
    """(module, role) of a key by its suffix; an unknown suffix is the role "unknown". Which suffix a key has
    follows from its last _LONGEST characters alone, which the keys of one template (every layer's, often
    every expert's) share, so the suffixes are tried once per distinct tail."""
    n, role = _suffix(name[-_LONGEST:])
    return (name[:-n] if n else name), role


@functools.lru_cache(maxsize=1 << 14)
def _suffix(tail: str) -> tuple[int, str]:
    for suffix, role in _BY_LENGTH:
        if tail.endswith(suffix):
            return len(suffix), role
    return 0, "unknown"


def peft_keys(keys: Sequence[str]) -> dict[str, tuple[str, str]]:
    """PEFT's layout: each key's (module, role), the module named less PEFT's base_model.model."""
    return {key: split_key(key.removeprefix(PEFT_PREFIX)) for key in keys}


def trainer_key(key: str, flat: Mapping[str, str]) -> tuple[str, str]:
    """(module, role) of a diffusion LoRA key, the module as the model's own trainers or diffusers name it:
    diffusion_model.<name> (BFL's and Wan's own), pipe.dit.<name> (DiffSynth-Studio), transformer.<name>
    (diffusers); lora_unet_<name, dots as underscores> (kohya, musubi, and VideoX-Fun's lora_unet__) and
    lora_transformer_<name likewise> (the "mixture" trainers), looked up in flat (its _-joined form ->
    the name), never split by guesswork; a name not found there keeps its key, which nothing maps."""
    for prefix in ("lora_unet__", "lora_unet_", "lora_transformer_"):
        if key.startswith(prefix):
            name, role = split_key(key.removeprefix(prefix))
            return flat.get(name, prefix + name), role
    for prefix in ("diffusion_model.", "pipe.dit.", "transformer."):
        if key.startswith(prefix):
            return split_key(key.removeprefix(prefix))
    return split_key(key)


class ModuleKeys(NamedTuple):
    """One module's tensors (entries, or shapes) by role, and each further key read as a role it
    already has: two weights for one place, of which neither is trusted."""

    roles: dict[str, Any]
    doubled: tuple[tuple[str, str], ...] = ()  # (role, key)


class Grouped(dict):
    """group_keys' answer, module -> ModuleKeys; ab, where every module is an A then a B under keys of their
    own (as PEFT and safetensors write them), the same as columns: the modules and their A's and B's values,
    taken from the key list by slicing, so an inspection of tens of thousands of modules need not walk them."""

    ab: tuple[list[str], list[Any], list[Any]] | None = None


def group_keys(values: Mapping[str, Any], convert_keys: ConvertKeys) -> dict[str, ModuleKeys]:
    """values (by checkpoint key) grouped by module and role, as convert_keys reads the keys."""
    keys = list(values)
    read = convert_keys(keys)
    paired = _paired(list(map(read.__getitem__, keys)), list(values.values()))
    if paired is not None:
        return paired
    roles: dict[str, dict[str, Any]] = {}
    doubled: dict[str, list[tuple[str, str]]] = {}
    for key, (module, role) in read.items():
        mine = roles.setdefault(module, {})
        if role in mine:
            doubled.setdefault(module, []).append((role, key))
        else:
            mine[role] = values[key]
    return {m: ModuleKeys(r, tuple(doubled.get(m, ()))) for m, r in roles.items()}


def _paired(read: list[tuple[str, str]], values: list[Any]) -> dict[str, ModuleKeys] | None:
    """group_keys where the keys come two by two, each two one module's (A and B, as PEFT and safetensors
    write them, in order) under two roles, no module twice: grouped in whole-list passes; else None."""
    if len(read) % 2:
        return None
    modules, roles = list(map(itemgetter(0), read)), list(map(itemgetter(1), read))
    firsts = modules[0::2]
    if firsts != modules[1::2] or len(set(firsts)) != len(firsts) or any(map(eq, roles[0::2], roles[1::2])):
        return None
    a, b = zip(roles[0::2], values[0::2], strict=True), zip(roles[1::2], values[1::2], strict=True)
    pairs = map(dict, zip(a, b, strict=True))
    # tuple.__new__ makes each ModuleKeys in C: its own __new__ is a Python call a module
    out = Grouped(zip(firsts, map(tuple.__new__, repeat(ModuleKeys), zip(pairs, repeat(()))), strict=True))
    if roles[0::2] == ["A"] * len(firsts) and roles[1::2] == ["B"] * len(firsts):
        out.ab = (firsts, values[0::2], values[1::2])
    return out
