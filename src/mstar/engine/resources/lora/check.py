"""Whether a deployment can serve an adapter, decided from the checkpoint's header."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from .adapter_config import AdapterConfig
from .checkpoint import Checkpoint, open_checkpoint
from .digest import HASH_ON_EVERY_CORE, adapter_digest, file_digest, streams_from_file
from .experts import checkpoint_orientations, stacked_misfit
from .header_json import no_collection
from .inspect_columns import Pairs, module_rank, plain_header, plain_info, plain_pairs
from .keys import ROLE_REASONS, SERVED_ROLES, ConvertKeys, ModuleKeys, group_keys
from .spec import AdapterInfo, Location, LoraSpec, as_linear, canonical_index

if TYPE_CHECKING:
    import torch

# Past this many tensors, a header listing more than the specs can serve is refused by its count alone.
EARLY_REFUSAL = 4096
# Modules whose LoRA changes the vocabulary side of the model, which the pool does not serve.
_VOCAB_MODULES = ("lm_head", "embed_tokens", "wte", "embed_out", "output_layer")
_VOCAB_ENDINGS = tuple(f".{m}" for m in _VOCAB_MODULES)
_PAIR = frozenset({"A", "B"})


def misfit(spec: LoraSpec, module: str, a_shape: Sequence[int], b_shape: Sequence[int],
           config: AdapterConfig | None = None) -> str | None:
    """Why a mapped module's A / B shapes do not fit its target, or None; where A and B disagree on the
    rank, config (its r for the module) tells which factor is the odd one."""
    loc = spec.locate(module)
    if loc is None:
        return f"no {spec.name} target maps it"
    return misfit_at(spec, loc, tuple(a_shape), tuple(b_shape), config, module)


def misfit_at(spec: LoraSpec, loc: Location, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
              config: AdapterConfig | None = None, module: str = "") -> str | None:
    """misfit of a module at loc: a function of where it lands and its shapes alone, not of its name, so
    the modules of one template (every layer's, every expert's) are judged once per distinct answer; only a
    rank disagreement between A and B reads the module's r from config, to name the odd factor."""
    name, layer, s = loc
    t = spec.targets[name]
    if layer >= t.layers:
        return f"layer {layer} is past the {t.layers} layers of target {name}"
    if t.experts is not None and s is None:
        return stacked_misfit(t, name, a_shape, b_shape, spec.max_rank)
    if isinstance(s, int) and s >= t.slices:
        count = t.experts.count if t.experts else t.slices
        return f"expert {s * count // t.slices} is past the model's {count} experts"
    if len(a_shape) < 2 or len(b_shape) != len(a_shape):
        return f"A {list(a_shape)} and B {list(b_shape)} are not a pair of LoRA factors"
    if t.kernel is None and len(a_shape) != 2:
        return f"A {list(a_shape)} is a conv factor, target {name} is a linear"
    if t.kernel is not None:
        want = (t.in_channels, *t.kernel)
        if len(a_shape) == 2 or a_shape[1:] != want:
            return f"A {list(a_shape)} needs [r, {', '.join(map(str, want))}] for the conv target {name}"
        if any(k != 1 for k in b_shape[2:]):
            return f"B {list(b_shape)} needs a kernel of ones"
    r = a_shape[0]
    if r < 1:
        return "rank 0"
    if r > spec.max_rank:
        return f"rank {r}, over this pool's max_rank {spec.max_rank}"
    a, b = as_linear(a_shape), as_linear(b_shape)
    if a[1] != t.in_features:
        return f"A {list(a_shape)} takes {a[1]} inputs, target {name} takes {t.in_features}"
    if b[1] != r:
        return rank_disagreement(list(a_shape), list(b_shape), b[1], config, module)
    out = sum(t.out_features[sl] for sl in t.covered(s))
    if b[0] != out:
        return f"B {list(b_shape)} should be [{out}, {r}] for target {name}"
    return None


def rank_disagreement(a: list[int], b: list[int], b_rank: int, config: AdapterConfig | None, module: str) -> str:
    """A's rows and B's columns, two ranks for one module: the factor the config's r disagrees with is named
    as the one cut or padded, never the one that agrees with it."""
    if config is None:
        return f"A {a} is rank {a[0]} and B {b} rank {b_rank}: the two factors disagree"
    want = config.rank_of(module)
    if want == a[0]:
        return f"B {b} is rank {b_rank}, but A {a} and {config.source}'s r={want} are rank {want}"
    if want == b_rank:
        return f"A {a} is rank {a[0]}, but B {b} and {config.source}'s r={want} are rank {want}"
    return f"A {a} is rank {a[0]} and B {b} rank {b_rank}, and {config.source} gives it r={want}"


def inspect_keys(spec: LoraSpec, items: Iterable[tuple[str, Sequence[int]]]) -> AdapterInfo:
    """inspect_adapter over (checkpoint key, shape) pairs, as a header lists them."""
    return _inspect(spec, group_keys({key: tuple(shape) for key, shape in items}, spec.convert_keys))


def _inspect(spec: LoraSpec, modules: dict[str, ModuleKeys], shape: Callable[[Any], tuple[int, ...]] = tuple,
             config: AdapterConfig | None = None) -> AdapterInfo:
    """inspect_keys over modules already grouped, whose role values give their shape through shape, under
    config where there is one: in passes over columns where every module is a plain pair that fits, else
    module by module."""
    plain = plain_info(spec, plain_pairs(modules, _VOCAB_MODULES), shape, misfit_at)
    return plain.info if plain is not None else _walk(spec, modules, shape, config)


def _walk(spec: LoraSpec, modules: dict[str, ModuleKeys], shape: Callable[[Any], tuple[int, ...]],
          config: AdapterConfig | None) -> AdapterInfo:
    """_inspect module by module, naming each misfit."""
    rank, unmapped, misfits, targets = 0, [], {}, set()
    placed: dict[tuple[str, int, int], str] = {}
    judged: dict[tuple, str | None] = {}  # misfit_at by (target, layer past the target's or -1, slice, shapes)
    for module, keys in sorted(modules.items()):
        roles = {role: shape(v) for role, v in keys.roles.items()}
        loc = spec.locate(module)
        if "A" in roles and loc is not None:  # another node's module is that node's to size
            rank = max(rank, module_rank(spec, loc, roles["A"]))
        why = refused_roles(module, roles, keys.doubled) or (None if loc is None else _unpaired(roles))
        if why is None and loc is not None:
            a, b = tuple(roles["A"]), tuple(roles["B"])
            key = (loc.target, loc.layer if loc.layer >= spec.targets[loc.target].layers else -1, loc.slice, a, b)
            if key not in judged:
                judged[key] = misfit_at(spec, loc, a, b)
            why = judged[key]
            if why is not None and config is not None:  # a misfit's words may name the module's own r
                why = misfit_at(spec, loc, a, b, config, module)
        if why:
            misfits[module] = why
        elif loc is None:
            unmapped.append(module)
        else:
            for sl in spec.targets[loc.target].covered(loc.slice):
                if (loc.target, loc.layer, sl) in placed:  # two spellings of one module: neither is guessed
                    misfits[module] = f"fills the same weights as {placed[loc.target, loc.layer, sl]}"
                placed.setdefault((loc.target, loc.layer, sl), module)
            targets.add(loc.target)
    return AdapterInfo(rank, tuple(unmapped), misfits, frozenset(targets))


def refused_roles(module: str, roles: dict[str, tuple[int, ...]], doubled: Sequence[tuple[str, str]]) -> str | None:
    """Why a module is refused whichever node would serve it: weights that are not plain LoRA (by
    name), two keys for one weight, an alpha that is not one number, LoRA on the vocabulary."""
    if not doubled and "alpha" not in roles and roles.keys() <= _PAIR:  # most modules: just A and B
        return _vocab(module)
    odd = sorted(r for r in roles if r not in SERVED_ROLES)
    why = [ROLE_REASONS.get(r, f"a {r} weight is not LoRA") for r in odd]
    # a weight refused by its role is refused once, however many keys it has (LoHa has six)
    why += [f"two keys read as its {role} ({key} is one)" for role, key in doubled if role in SERVED_ROLES]
    if why:
        return "; ".join(why)
    if "alpha" in roles and math.prod(roles["alpha"]) != 1:
        return f"alpha {list(roles['alpha'])} is not one number"
    return _vocab(module)


def _vocab(module: str) -> str | None:
    if module.endswith(_VOCAB_ENDINGS) or module in _VOCAB_MODULES:
        return f"LoRA on {module.rsplit('.', 1)[-1]} is not served"
    return None


def _unpaired(roles: dict[str, tuple[int, ...]]) -> str | None:
    if "A" not in roles or "B" not in roles:
        return f"lora_{'B' if 'A' in roles else 'A'} is missing"
    return None


def inspect_checkpoint(spec: LoraSpec, ckpt: Checkpoint) -> AdapterInfo:
    """What spec makes of the checkpoint's header and config: once per distinct header and config."""
    key = ("inspect", spec, repr(ckpt.config))
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _inspect_header(spec, ckpt)
    return memo[key]


def header_pairs(ckpt: Checkpoint, convert_keys: ConvertKeys) -> Pairs | None:
    """plain_pairs of the checkpoint's modules as convert_keys reads them: once per header and conversion, for
    every node that inspects it."""
    key = ("pairs", convert_keys)
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = plain_pairs(ckpt.modules(convert_keys), _VOCAB_MODULES)
    return memo[key]


def _inspect_header(spec: LoraSpec, ckpt: Checkpoint) -> AdapterInfo:
    modules, config = ckpt.modules(spec.convert_keys), ckpt.config
    plain = plain_info(spec, header_pairs(ckpt, spec.convert_keys), attrgetter("shape"), misfit_at)
    info = plain.info if plain is not None else _walk(spec, modules, attrgetter("shape"), config)
    ways = checkpoint_orientations(spec, ckpt)
    rules = ckpt.module_rules(spec.convert_keys)
    if plain is not None and plain_header(spec, plain, config, rules, ways):
        return AdapterInfo(info.rank, info.unmapped, {}, info.targets)
    misfits = dict(info.misfits)
    skip = set(misfits) | set(info.unmapped)  # judged already, or another node's
    for module, keys in modules.items():
        a, b = keys.roles.get("A"), keys.roles.get("B")
        if a is None or b is None or module in skip:
            continue
        if a.dtype not in ("F32", "F16", "BF16") or b.dtype != a.dtype:
            misfits[module] = f"factors of dtype {a.dtype} / {b.dtype}; LoRA weights are floats of one dtype"
        loc = spec.locate(module)
        r = module_rank(spec, loc, a.shape)
        if config is not None and r != rules[module].rank:
            misfits[module] = (f"rank {r}, but {config.source} gives it r={rules[module].rank}, "
                               "so its scaling is unknown")
        if ways.get(module, "A in") not in ("A in", "A out"):
            misfits[module] = ways[module]
        if config is not None and not config.transforms_layer(module):
            layer = config.layer_of(module)
            misfits[module] = (f"layer {layer} is outside layers_to_transform {list(config.layers_to_transform)}"
                               if layer is not None else "it has no layer index for layers_to_transform to take")
        if config is not None and not rules[module].targeted:
            misfits[module] = (f"{config.source}'s target_modules / exclude_modules leave it out, so PEFT puts no "
                               "LoRA there and would drop these weights")
    return AdapterInfo(info.rank, info.unmapped, misfits, info.targets)


def module_reasons(problems: dict[str, str]) -> list[str]:
    """One line per distinct reason, naming its first module and counting the rest, so a rank over
    max_rank in every layer reads as one line, not hundreds."""
    by_reason: dict[str, list[str]] = {}
    for module, why in sorted(problems.items()):
        by_reason.setdefault(why, []).append(module)
    lines = []
    for why, modules in by_reason.items():
        n = len(modules) - 1
        more = f" (and {n} more module{'s' if n > 1 else ''} alike)" if n else ""
        lines.append(f"module {modules[0]}: {why}{more}")
    return lines


def refuse_misfits(spec: LoraSpec, ckpt: Checkpoint) -> None:
    """Raise ValueError naming every module spec maps but cannot serve; the rest are other nodes'."""
    info = inspect_checkpoint(spec, ckpt)
    if info.misfits:
        raise ckpt.refusal(module_reasons(dict(info.misfits)))


def inspect_adapter(spec: LoraSpec, path: str | os.PathLike[str]) -> AdapterInfo:
    """Rank, unmapped and misfitting modules of the checkpoint at path.

    Reads only the safetensors header unless the model converts a native layout, which needs
    the tensors.
    """
    with open_checkpoint(path) as ckpt:
        return inspect_checkpoint(spec, ckpt)


def adapter_targets(spec: LoraSpec, path: str | os.PathLike[str]) -> set[str]:
    """The targets of spec the checkpoint at path holds LoRA weights for."""
    return set(inspect_adapter(spec, path).targets)


def check_adapter_file(
    spec: LoraSpec, name: str, path: str | os.PathLike[str], others: Sequence[LoraSpec] = (), *,
    hash_threads: int = HASH_ON_EVERY_CORE,
) -> bytes:
    """The adapter at path checked against spec and the model's others (its LoRA specs for other
    nodes, a vision tower's say, which serve the same adapters), each from the checkpoint's header;
    returns its digest. The digest is read once per way the specs convert the checkpoint
    (convert_keys), so once for specs that read it alike. Raises ValueError for an adapter the
    deployment cannot serve."""
    with open_checkpoint(path, name) as ckpt:
        return check_checkpoint(spec, ckpt, others, hash_threads=hash_threads)


def check_adapter_tensors(spec: LoraSpec, name: str, tensors: Mapping[str, torch.Tensor], config: Any = None,
                          others: Sequence[LoraSpec] = ()) -> bytes:
    """check_adapter_file for an adapter pushed from memory (memory.tensor_checkpoint says what it takes);
    its digest is the one the same weights saved as a file would have."""
    from .memory import tensor_checkpoint

    return check_checkpoint(spec, tensor_checkpoint(name, tensors, config), others)


def check_checkpoint(spec: LoraSpec, ckpt: Checkpoint, others: Sequence[LoraSpec] = (), *,
                     hash_threads: int = HASH_ON_EVERY_CORE) -> bytes:
    """check_adapter_file for a checkpoint already open."""
    if not ckpt.header.tensors:  # serving it would be the base model under an adapter's name
        raise ckpt.refusal(["it holds no weights"])
    specs = (spec, *others)
    most = most_tensors(specs)
    # Refused before any of them is grouped, located or matched; a small header is judged module by module
    # (milliseconds), which names what is wrong with each.
    if len(ckpt.header.tensors) > max(most, EARLY_REFUSAL):
        raise ckpt.refusal([f"its header lists {len(ckpt.header.tensors)} tensors, more than the {most} that "
                            f"{', '.join(s.name for s in specs)} can serve (A, B and an alpha for each layer and "
                            "slice of each target)"])
    with no_collection():  # a header never seen: tens of thousands of objects, none cyclic
        problems = adapter_problems(specs, ckpt)
    if problems:
        raise ckpt.refusal(module_reasons(problems))
    digests: dict = {}
    for s in specs:  # once per way the specs convert the checkpoint
        if s.convert_keys not in digests:
            digests[s.convert_keys] = (file_digest(ckpt, s.convert_keys, hash_threads) if streams_from_file(ckpt)
                                       else adapter_digest(ckpt, s.convert_keys, threads=hash_threads))
    return digests[spec.convert_keys]


def most_tensors(specs: Sequence[LoraSpec]) -> int:
    """The most tensors an adapter these specs serve can list: every module lies on a layer and slice of a
    target no other module takes, and holds A, B and at most an alpha; any other weight is refused."""
    return 3 * sum(t.layers * t.slices for s in specs for t in s.targets.values())


def adapter_problems(specs: Sequence[LoraSpec], ckpt: Checkpoint) -> dict[str, str]:
    """module -> why, over every node: misfits anywhere, and modules no node maps. Once per header, specs and
    config, as the inspections it joins are (so the dict is shared: read it, never change it)."""
    key = ("problems", tuple(specs), repr(ckpt.config))
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _problems(specs, ckpt)
    return memo[key]


def _problems(specs: Sequence[LoraSpec], ckpt: Checkpoint) -> dict[str, str]:
    infos = [inspect_checkpoint(s, ckpt) for s in specs]
    problems: dict[str, str] = {}
    names = ", ".join(s.name for s in specs)
    has_experts = any(t.experts is not None for s in specs for t in s.targets.values())
    for module in sorted(set.intersection(*(set(i.unmapped) for i in infos))):
        odd = [n for n in re.findall(r"(?<![^._])(\d+)(?![^._])", module) if not canonical_index(n)]
        if odd:
            problems[module] = f"index {odd[0]!r} is not written as a model numbers its layers and experts"
        elif ".experts." in f"{module}." and not has_experts:
            problems[module] = "expert weights, and this model has no experts"
        else:
            problems[module] = f"no target of {names} maps it"
    for info in infos:
        problems.update(info.misfits)
    return problems


def check_adapters(spec: LoraSpec, others: Sequence[LoraSpec] = (), *, workers: int | None = None,
                   ) -> dict[str, bytes]:
    """Every adapter spec serves, through check_adapter_file (against others too); returns each
    one's digest.

    Raises naming every adapter that fails, so a bad adapter in the serving config stops the
    deployment at startup, the same whether or not a worker would have preloaded it. Adapters are
    checked on workers threads (default: one per core), each hashing on one core.
    """
    return check_all(spec, spec.adapters, others, workers=workers)


def check_all(spec: LoraSpec, adapters: Mapping[str, str | os.PathLike[str]], others: Sequence[LoraSpec] = (), *,
              workers: int | None = None) -> dict[str, bytes]:
    """check_adapters over the adapters given (name -> path) rather than the spec's."""
    def check(item: tuple[str, str | os.PathLike[str]]) -> bytes | str:
        try:
            return check_adapter_file(spec, *item, others, hash_threads=1)
        except ValueError as e:
            return str(e)

    with ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="mstar-lora-check") as pool:
        results = dict(zip(adapters, pool.map(check, adapters.items()), strict=True))
    digests = {name: r for name, r in results.items() if isinstance(r, bytes)}
    failures = [r for r in results.values() if isinstance(r, str)]
    if failures:
        raise ValueError(unservable(failures, len(adapters)))
    return digests


def unservable(failures: Sequence[str], total: int) -> str:
    """The refusals of failures (each naming its adapter) of total adapters checked, under a line counting
    them where more than one was checked."""
    if total == 1:
        return failures[0]
    count = f"none of the {total}" if len(failures) == total else f"{len(failures)} of {total}"
    verb = "can" if len(failures) == total else "cannot"
    return f"{count} adapters {verb} be served:\n" + "\n".join(failures)
