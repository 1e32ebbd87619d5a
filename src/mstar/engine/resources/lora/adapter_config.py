"""An adapter's LoRA config (PEFT's adapter_config.json, or the one diffusers writes into a file's
metadata): the rank and scaling it gives each module, and the options not served."""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from . import patterns
from .json_file import read_json

# Options that change the delta (or the base it applies to) in ways this pool does not serve.
# An adapter setting any of them is refused rather than served wrong.
UNSERVED_OPTIONS = {
    "use_dora": "DoRA (use_dora) rescales the whole weight, not a low-rank delta",
    "lora_bias": "lora_bias adds a bias to lora_B",
    "use_qalora": "QALoRA (use_qalora) pools its input",
    "layer_replication": "layer_replication changes the base model's layers",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) applies from an invocation on",
    "arrow_config": "arrow_config routes between adapters",
    "kasa_config": "KaSA (kasa_config) adds a singular-value scale",
    "use_bdlora": "BD-LoRA (use_bdlora) uses block-diagonal factors",
    "monteclora_config": "MonteCLoRA (monteclora_config) samples its factors",
    "fan_in_fan_out": "fan_in_fan_out stores factors for a transposed base weight",
}
# These initialisations leave a residual in the base weights that the served base lacks.
MAX_LAYER_PATTERNS = 64  # in one layers_pattern list: PEFT's own list of common ones has a handful
RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a LoRA config that decide each module's rank and scaling; source says where it
    was read from, for messages."""

    r: int = 8
    lora_alpha: float = 8
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()  # regexes, each for the dotted words just before a layer's index
    source: str = "adapter_config.json"
    target_modules: frozenset[str] | str | None = None  # names, or one regex; None: whatever the file holds
    exclude_modules: frozenset[str] | str | None = None
    target_parameters: frozenset[str] | None = None

    @property
    def scaling(self) -> float:
        """The adapter's scaling, lora_alpha / r (or / sqrt(r) with rsLoRA)."""
        return self.scale(self.lora_alpha, self.r)

    def scale(self, alpha: float, r: int) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def rank_of(self, module: str) -> int:
        return self.module_rules([module])[module].rank

    def module_scaling(self, module: str) -> float:
        """This module's own scaling, with PEFT's pattern rule for rank_pattern and alpha_pattern."""
        return self.module_rules([module])[module].scaling

    def targets(self, module: str) -> bool:
        """Whether PEFT, loading this config, puts LoRA on module (as the model names it): target_modules
        (names matched whole or as a dotted suffix, or one regex matched whole; "all-linear" every linear)
        or target_parameters name it, and exclude_modules does not. A file's weights for any other
        module PEFT drops without a word; this pool refuses them instead."""
        return self.module_rules([module])[module].targeted

    def module_rules(self, modules: Collection[str]) -> dict[str, ModuleRule]:
        """Each module's rank, scaling and whether the config targets it (rank_of, module_scaling,
        targets), its patterns matched in one pass (patterns.Matching) whose work and memory the names
        bound: ValueError naming the pattern that costs more, and what it cost. Nothing of the pass is
        kept."""
        matching = patterns.Matching(modules)
        ranks = _Values(self.rank_pattern, matching, "rank_pattern")
        alphas = _Values(self.alpha_pattern, matching, "alpha_pattern")
        target = _Names(self.target_modules, matching, "target_modules")
        exclude = _Names(self.exclude_modules, matching, "exclude_modules")
        rules = {}
        for module in modules:
            rank = int(ranks.get(module, self.r))
            rules[module] = ModuleRule(rank, self.scale(alphas.get(module, self.lora_alpha), rank),
                                       self._targets(module, target, exclude))
        return rules

    def _targets(self, module: str, target: _Names, exclude: _Names) -> bool:
        if self.exclude_modules and exclude.has(module):
            return False
        if self.target_modules is None:
            return self.target_parameters is None or self._parameter_targeted(module)
        if isinstance(self.target_modules, str) and self.target_modules.lower() == "all-linear":
            return True
        return target.has(module) or self._parameter_targeted(module)

    def _parameter_targeted(self, module: str) -> bool:
        """Whether target_parameters name module's LoRA: a stacked parameter's, named module.parameter as its
        keys are read, or a module's own weight (a router's, mlp.gate.weight)."""
        return bool(self.target_parameters) and (_names(self.target_parameters, module)
                                                 or _names(self.target_parameters, module + ".weight"))

    def layer_of(self, module: str) -> int | None:
        """The layer index PEFT reads from module for layers_to_transform, with PEFT's own regexes: the
        first number after two dotted words, or one right after a layers_pattern (patterns in order)."""
        for regex in map(_layer_regex, self.layers_pattern or (None,)):
            match = regex.match(module)
            if match is not None:
                index = match.groupdict().get("idx")
                return None if index is None else int(index)
        return None

    def transforms_layer(self, module: str) -> bool:
        """Whether layers_to_transform lets PEFT put LoRA on module. As in PEFT, it restricts only modules a
        target_modules list takes by a dotted suffix: a module it names whole is taken in every layer, an
        empty list restricts nothing, and target_parameters are taken in every layer."""
        if not self.layers_to_transform:
            return True
        if isinstance(self.target_modules, frozenset) and module in self.target_modules:
            return True
        if self._parameter_targeted(module):
            return True
        return self.layer_of(module) in self.layers_to_transform


@functools.lru_cache(maxsize=MAX_LAYER_PATTERNS + 1)
def _layer_regex(pattern: str | None) -> re.Pattern[str]:
    """PEFT's regex for a layer index (check_target_module_exists), layers_pattern pasted in as PEFT pastes
    it. Only patterns that neither repeat nor alternate are taken (_layer_patterns), so matching stays
    polynomial in the name's length."""
    if pattern is None:
        return re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")
    return re.compile(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.")


@dataclass(frozen=True)
class ModuleRule:
    """What a config gives one module: its rank, its scaling, and whether PEFT puts LoRA on it."""

    rank: int
    scaling: float
    targeted: bool


def _names(names: frozenset[str], module: str) -> bool:
    # PEFT: the name itself, or a dotted suffix of it, is listed
    return module in names or any(module[i + 1 :] in names for i, ch in enumerate(module) if ch == ".")


class _Names:
    """target_modules or exclude_modules as a test of module names, in a pass of matching."""

    def __init__(self, names: frozenset[str] | str | None, matching: patterns.Matching, label: str) -> None:
        self.names = names
        if isinstance(names, str):
            self.regex = matching.regex(names, f"{label} {_short(names)}")

    def has(self, module: str) -> bool:
        return self.regex(module) if isinstance(self.names, str) else _names(self.names, module)


class _Values:
    """rank_pattern or alpha_pattern by PEFT's rule: keys in the file's order, the first whose
    (.*\\.)?(key)$ matches wins."""

    def __init__(self, values: Mapping[str, float], matching: patterns.Matching, label: str) -> None:
        self.keys = matching.keys(list(values), label) if values else None
        self.values = list(values.values())

    def get(self, module: str, default: float) -> float:
        i = None if self.keys is None else self.keys.first(module)
        return default if i is None else self.values[i]


def parse_config(raw: object, source: str = "adapter_config.json") -> AdapterConfig:
    """An AdapterConfig from a parsed LoRA config; ValueError listing every unserved option."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source} is not a JSON object")
    if source == "adapter_config.json" and "peft_type" not in raw:  # PEFT writes it in every adapter_config.json
        if "lora_parameters" in raw or "fine_tune_type" in raw:
            raise ValueError("adapter_config.json is mlx-lm's (lora_parameters, fine_tune_type), not PEFT's: its "
                             "keys and scale are mlx-lm's own; convert the adapter to PEFT's format first")
        raise ValueError("adapter_config.json is not PEFT's: it has no peft_type")
    problems = []
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        problems.append(f"peft_type {peft_type!r} is not LoRA")
    for key, why in UNSERVED_OPTIONS.items():
        if raw.get(key):
            problems.append(why)
    if raw.get("bias", "none") != "none":
        problems.append(f"bias {raw['bias']!r} trains biases, which are not served")
    if raw.get("modules_to_save"):
        problems.append(f"modules_to_save {raw['modules_to_save']!r} replaces whole modules")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(RESIDUAL_INITS):
        problems.append(
            f"init_lora_weights {init!r} assumes modified base weights; convert it to plain LoRA "
            "(path_initial_model_for_weight_conversion) first"
        )
    try:
        config = AdapterConfig(
            r=_positive(raw.get("r", 8), "r", int),
            lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha"),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=_patterns(raw.get("rank_pattern"), "rank_pattern", int),
            alpha_pattern=_patterns(raw.get("alpha_pattern"), "alpha_pattern", float),
            layers_to_transform=_layers(raw.get("layers_to_transform")),
            layers_pattern=_layer_patterns(raw.get("layers_pattern")),
            source=source,
            target_modules=_modules(raw.get("target_modules"), "target_modules"),
            exclude_modules=_modules(raw.get("exclude_modules"), "exclude_modules"),
            target_parameters=_modules(raw.get("target_parameters"), "target_parameters", regex=False),
        )
    except ValueError as e:
        problems.append(str(e))
        config = None
    # as PEFT's LoraConfig refuses them, by the values as given
    if isinstance(raw.get("target_modules"), str):
        problems += [f"{k} with a target_modules regex, a config PEFT refuses to load"
                     for k in ("layers_to_transform", "layers_pattern") if raw.get(k) is not None]
    if raw.get("layers_pattern") and raw.get("layers_to_transform") is None:
        problems.append("layers_pattern without layers_to_transform, a config PEFT refuses to load")
    if problems:
        raise ValueError("; ".join(problems))
    return config


def read_config(path: str | os.PathLike[str]) -> AdapterConfig:
    """The config in the adapter_config.json at path: a regular file, read without blocking (json_file)."""
    try:
        raw = read_json(path)
    except ValueError as e:
        raise ValueError(f"adapter_config.json is {e}") from None
    return parse_config(raw)


MAX_KEYS = 1 << 16  # pattern keys or module names in one config field: one per module of the largest models
MAX_RANK = (1 << 31) - 1  # past any rank a factor could have; keeps every scaling a float


def _number(v: object, what: str) -> float:
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError
        return float(v) if isinstance(v, int) and abs(v) > MAX_RANK else v
    except (ValueError, OverflowError):
        text = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ValueError(f"{what} {text} is not a finite number") from None


def _positive(v: object, what: str, kind: type) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_RANK:
        text = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ValueError(f"{what} {text} is not a positive integer of at most {MAX_RANK}")
    return kind(v)


def _patterns(v: object, what: str, kind: type) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{what} is not a map of module patterns")
    if len(v) > MAX_KEYS:
        raise ValueError(f"{what} has {len(v)} keys, over {MAX_KEYS}")
    out, states = {}, 0
    for key, value in v.items():
        try:
            states += patterns.check_key(key)
        except ValueError as e:
            raise ValueError(f"{what} key {_short(key)} cannot be matched: {e}") from None
        if states > patterns.MAX_CONFIG_STATES:
            raise ValueError(f"{what}'s keys that repeat or alternate unfold to more than {patterns.MAX_CONFIG_STATES} "
                             "states together, past what the check matches")
        out[key] = _positive(value, f"{what}[{key!r}]", int) if kind is int else _number(value, f"{what}[{key!r}]")
    return out


def _modules(v: object, what: str, regex: bool = True) -> frozenset[str] | str | None:
    """target_modules and the like: a list of names (a set, saved), or one regex where regex."""
    if v is None:
        return None
    if isinstance(v, str) and regex:
        try:
            patterns.check_pattern(v)
        except ValueError as e:
            raise ValueError(f"{what} {_short(v)} cannot be matched: {e}") from None
        return v
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or len(v) > MAX_KEYS:
        raise ValueError(f"{what} is not a list of module names")
    return frozenset(v)


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "..."


def _layers(v: object) -> tuple[int, ...] | None:
    if v is None:
        return None
    v = [v] if isinstance(v, int) else v
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"layers_to_transform {v!r} is not a list of layer indices")
    return tuple(v)


def _layer_patterns(v: object) -> tuple[str, ...]:
    if v is None or v == "" or v == []:  # PEFT's own test for "any layer pattern"
        return ()
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("layers_pattern is not a pattern or a list of them")
    if len(v) > MAX_LAYER_PATTERNS:
        raise ValueError(f"layers_pattern lists {len(v)} patterns, over {MAX_LAYER_PATTERNS}")
    for pattern in v:
        try:
            if patterns.check_pattern(pattern):
                raise ValueError("it repeats or alternates, and PEFT's layer regex around it would then backtrack")
            _layer_regex(pattern)
        except (ValueError, re.error) as e:  # re.error: valid alone, but not pasted into PEFT's regex
            raise ValueError(f"layers_pattern {_short(pattern)} cannot be matched: {e}") from None
    return tuple(v)  # an empty one in a list matches only an empty word, as in PEFT
