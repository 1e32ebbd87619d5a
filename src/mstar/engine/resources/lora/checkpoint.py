"""An adapter on disk: where its files are, its checked header and config, its modules and scalings."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from . import hub, safetensors_header
from .acyclic import untrack
from .adapter_config import AdapterConfig, ModuleRule, parse_config, read_config
from .header_entries import FLOAT_DTYPES
from .keys import PEFT_PREFIX, ConvertKeys, ModuleKeys, group_keys
from .safetensors_header import Header, NotSafetensors, TensorEntry, read_header
from .source import FileSource, Source, TensorSource

if TYPE_CHECKING:
    import torch

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
# Where diffusers' save_lora_weights puts the LoraConfig of each component, keys prefixed by it.
DIFFUSERS_METADATA = "lora_adapter_metadata"

NUMBER_DTYPES = FLOAT_DTYPES | {"I64", "I32", "I16", "I8", "U8"}
Modules = dict[str, ModuleKeys]  # module -> its TensorEntry by role


def where(name: str, path: str | os.PathLike[str]) -> str:
    return f"adapter {name!r} ({path})"


def refusal(name: str, path: str | os.PathLike[str], reasons: Iterable[str]) -> ValueError:
    """One ValueError naming the adapter and file, listing every reason."""
    reasons = list(reasons)
    if len(reasons) == 1:
        return ValueError(f"{where(name, path)}: {reasons[0]}")
    return ValueError(f"{where(name, path)}:\n" + "\n".join(f"  - {r}" for r in reasons))


def locate_files(path: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """(weights, config) of a PEFT adapter directory, or of a safetensors file. A file named on its
    own is read with what it carries (its metadata, its alpha tensors): a config beside it is taken
    only for PEFT's adapter_model.safetensors, so one adapter's config never reads another's file."""
    try:
        return _locate(Path(path))
    except OSError as e:  # a name over NAME_MAX, a folder that cannot be listed
        raise ValueError(f"cannot be opened ({e.strerror or e})") from None


def _locate(p: Path) -> tuple[Path, Path | None]:
    if p.is_dir():
        weights = p / WEIGHTS
        if not weights.is_file():
            if (p / "adapter_model.bin").exists():
                raise ValueError("only adapter_model.bin, a pickle this pool does not read: save it as safetensors")
            raise ValueError(f"no {WEIGHTS} in the directory")
        if not os.path.lexists(p / CONFIG):  # one that is there but no file is read_config's to refuse
            raise ValueError(f"no {CONFIG} beside {weights.name}, so its rank and alpha are unknown")
    elif p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p.name} is not a safetensors file")
        weights = p
    elif p.exists():
        raise ValueError("not a regular file or directory")
    else:
        raise ValueError("no such file or directory")
    config = weights.parent / CONFIG
    return weights, config if weights.name == WEIGHTS and os.path.lexists(config) else None


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """An adapter whose header and config have been read and checked, weights unread.

    config is the one LoRA config that gives rank and alpha, whatever its source: adapter_config.json,
    else the LoraConfig diffusers writes into the file's metadata, else None (a trainer's file, whose
    alphas, if any, are tensors of their own). An adapter pushed from memory has its tensors here
    (memory.py), its header describing them as a file would, and weights naming where it came from.
    """

    name: str
    weights: Path
    header: Header
    config: AdapterConfig | None
    tensors: Mapping[str, torch.Tensor] | None = None
    source: FileSource | None = None  # the weights file, open from its header on, for this checkpoint's reads

    def refusal(self, reasons: Iterable[str]) -> ValueError:
        """One ValueError naming the adapter, its file and every reason; the header's parse, and all derived
        from it, is let go of: a refused adapter keeps no memory, however many are refused."""
        safetensors_header.forget(self.header)
        return refusal(self.name, self.weights, reasons)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the file (a checkpoint's reads are over); it is also let go when collected."""
        if self.source is not None:
            self.source.close()

    def number(self, e: TensorEntry) -> float | int:
        """The value of the one-element tensor e describes (an alpha): the pushed one's, or its bytes read
        from the file, decoded without torch."""
        if self.tensors is not None:
            return self.tensors[self._keys[e.start]].detach().reshape(-1)[0].item()
        data = self.source.read(e.nbytes, e.start)
        if len(data) != e.nbytes:
            raise self.refusal(["the file ended early: it was cut since its header was read"])
        return decode_number(e.dtype, data)

    @cached_property
    def _keys(self) -> dict[int, str]:
        return {e.start: key for key, e in self.header.tensors.items()}

    def alpha_entries(self, convert_keys: ConvertKeys) -> list[TensorEntry]:
        """The alpha tensors whose values give modules their scalings."""
        return list(self._alpha_entries(convert_keys).values())

    def with_alphas(self, values: Mapping[int, bytes]) -> Checkpoint:
        """This checkpoint with its alpha tensors' bytes as given (by their start): the scalings of bytes a
        read hashed, not of whatever the file or the tensors hold a moment later."""
        return dataclasses.replace(self, tensors=None, source=_Bytes(values, self.size))

    @property
    def data(self) -> Source:
        """What a read of the weights reads from: the one open file, or the pushed tensors at the offsets
        their header gives them."""
        if self.tensors is None:
            return self.source
        return TensorSource(list(self.tensors.values()), [e.start for e in self.header.tensors.values()], self.size)

    @property
    def size(self) -> int:
        """The file's size when its header was read."""
        return self.header.file_size

    def modules(self, convert_keys: ConvertKeys) -> Modules:
        """Each module's tensors by role, as convert_keys reads the keys (once per header and conversion)."""
        memo = self.header.memo
        if convert_keys not in memo:
            grouped = group_keys(self.header.tensors, convert_keys)
            # each a dict of entries and a tuple of names: in no cycle, out of the collector's passes (acyclic.py)
            if set(map(type, self.header.tensors.values())) <= {TensorEntry}:
                untrack(chain.from_iterable((keys, keys.roles) for keys in grouped.values()))
            memo[convert_keys] = grouped
        return memo[convert_keys]

    def module_rules(self, convert_keys: ConvertKeys) -> dict[str, ModuleRule]:
        """What the config gives each module as convert_keys reads them (AdapterConfig.module_rules), once
        per distinct header and config; {} without a config. A config whose patterns cost more to match
        than these names allow is refused naming the file it came from."""
        if self.config is None:
            return {}
        key = ("rules", convert_keys, repr(self.config))
        if key not in self.header.memo:
            try:
                self.header.memo[key] = module_rules(self.config, list(self.modules(convert_keys)))
            except ValueError as e:
                why = str(e)
            else:
                return self.header.memo[key]
            # raised here, not in the except clause, so that no traceback of the pass keeps its automata
            raise refusal(self.name, self.config_file, [why])
        return self.header.memo[key]

    @property
    def config_file(self) -> Path:
        """Where the config was read from: the adapter_config.json beside the weights, else the weights
        (a config in their metadata, or pushed with them)."""
        if self.config is not None and self.config.source == CONFIG:
            return self.weights.parent / CONFIG
        return self.weights

    def scalings(self, convert_keys: ConvertKeys) -> dict[str, float]:
        """Each module's alpha / r (or / sqrt(r) with rsLoRA), from its alpha tensor, else the config,
        else 1: a trainer that writes no alpha means alpha = rank."""
        if convert_keys not in self._scalings:
            alphas = self._alphas(convert_keys)
            if alphas:
                self._scalings[convert_keys] = self._module_scalings(convert_keys, alphas)
            else:  # the header and the config decide them: once per distinct pair
                key = ("scalings", convert_keys, repr(self.config))
                if key not in self.header.memo:
                    self.header.memo[key] = self._module_scalings(convert_keys, {})
                self._scalings[convert_keys] = self.header.memo[key]
        return self._scalings[convert_keys]

    def scaling(self, convert_keys: ConvertKeys) -> float:
        """The adapter's own scaling: the config's, else the scaling most modules share (so folding
        the rest into B changes the fewest); 1 where that is 0, so module scalings still fold."""
        if self.config is not None:
            return self.config.scaling or 1.0
        counts = Counter(self.scalings(convert_keys).values())
        return max(counts, key=lambda s: (counts[s], -s)) if counts else 1.0

    def _module_scalings(self, convert_keys: ConvertKeys, alphas: dict[str, float]) -> dict[str, float]:
        out, rules = {}, self.module_rules(convert_keys)
        if not alphas and self.config is not None:  # the config's alone: its rules' scalings
            return {module: rules[module].scaling for module in self.modules(convert_keys)}
        for module, keys in self.modules(convert_keys).items():
            a = keys.roles.get("A")
            r = a.shape[0] if a is not None and a.shape else 0
            if module in alphas:
                out[module] = (alphas[module] if alphas[module] > 0 else r) / r if r else 1.0
            elif self.config is not None:
                out[module] = rules[module].scaling
            else:
                out[module] = 1.0
        return out

    def _alpha_entries(self, convert_keys: ConvertKeys) -> dict[str, TensorEntry]:
        key = ("alphas", convert_keys)
        if key not in self.header.memo:
            modules = self.modules(convert_keys)
            if getattr(modules, "ab", None) is not None:  # every module exactly an A and a B (keys.Grouped)
                self.header.memo[key] = {}
            else:
                self.header.memo[key] = {m: k.roles["alpha"] for m, k in modules.items() if "alpha" in k.roles}
        return self.header.memo[key]

    def _alphas(self, convert_keys: ConvertKeys) -> dict[str, float]:
        """Each alpha tensor's value, read alone (the file is read only where there are any)."""
        out: dict[str, float] = {}
        for module, e in self._alpha_entries(convert_keys).items():
            try:
                out[module] = alpha_value(e, self.number)
            except ValueError as err:
                raise self.refusal([f"module {module}: {err}"]) from None
        return out

    @cached_property
    def _scalings(self) -> dict[ConvertKeys, dict[str, float]]:
        return {}


# A module's template: its name with every digit a 0, so every layer's and expert's module of one kind
# shares one (layers.3 and layers.7 do, layers.3 and layers.12 do not: their lengths differ).
_ZEROS = bytes.maketrans(b"123456789", b"000000000")  # bytes.translate: 10x str.translate
_DIGIT = re.compile(r"[0-9]")
_WORDS = re.compile(r"[A-Za-z_.\-]+")  # a rank_pattern / alpha_pattern key of names alone, no digit


def module_rules(config: AdapterConfig, modules: list[str]) -> dict[str, ModuleRule]:
    """config.module_rules(modules), matched once per template where the config cannot tell one
    module's digits from another's (digit_blind): every module of a template then gets its rule."""
    if not digit_blind(config):
        return config.module_rules(modules)
    templates = [m.encode("utf-8", "surrogatepass").translate(_ZEROS) for m in modules]
    first = dict(zip(templates, modules, strict=True))  # a template -> one of its modules (the last)
    rules = config.module_rules(list(first.values()))
    by_template = {t: rules[m] for t, m in first.items()}
    return {m: by_template[t] for m, t in zip(modules, templates, strict=True)}


def digit_blind(config: AdapterConfig) -> bool:
    """Whether config's rule for a module is the same for every module of its template: its names
    (target_modules, exclude_modules, target_parameters) hold no digit, and it has no regex but plain
    rank_pattern / alpha_pattern keys of letters, _, - and dots without a digit. Such a name or key
    matches a module's characters at fixed places, a dot any character, so it matches every digit
    alike, and a template fixes where each digit is; none spends a Matching's budget, so no refusal
    turns on how many modules are matched."""
    if isinstance(config.target_modules, str) and config.target_modules.lower() != "all-linear":
        return False
    if isinstance(config.exclude_modules, str):
        return False
    names = [*(config.target_modules if isinstance(config.target_modules, frozenset) else ()),
             *(config.exclude_modules or ()), *(config.target_parameters or ())]
    keys = [*config.rank_pattern, *config.alpha_pattern]
    return (not any(_DIGIT.search(n) for n in names)
            and all(_WORDS.fullmatch(k) for k in keys))


def decode_number(dtype: str, data: bytes) -> float | int:
    """One little-endian number of a safetensors dtype, as torch would read it (bfloat16 is float32's upper
    half)."""
    if dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + data)[0]
    if dtype in ("F64", "F32", "F16"):
        return struct.unpack({"F64": "<d", "F32": "<f", "F16": "<e"}[dtype], data)[0]
    return int.from_bytes(data, "little", signed=dtype != "U8")


def alpha_value(e: TensorEntry, read: Callable[[TensorEntry], float | int]) -> float:
    """The value of a one-element tensor (a trainer's alpha), read only once it is one: a float, or an
    integer, as several kohya and musubi scripts store it and kohya's loaders, diffusers and ComfyUI read it."""
    if e.dtype not in NUMBER_DTYPES or math.prod(e.shape) != 1:
        raise ValueError(f"an alpha must be one number, not {e.dtype} {list(e.shape)}")
    value = read(e)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"alpha {value} is not a finite, non-negative number")
    return value


def default_name(path: str | os.PathLike[str]) -> str:
    """A directory's name; a file's stem, or its directory's name for PEFT's adapter_model.safetensors; a
    Hub id's repo name, with its revision where one is given (a commit's first 12 hex digits, a ref's
    slashes as dashes): `org/repo@<commit>` is `repo@0123456789ab`."""
    try:
        found = hub.hub_id(path)
    except OSError:  # a name too long to look up is no Hub id either
        found = None
    if found is not None:
        repo, revision = found
        name = repo.split("/")[1]
        if revision is None:
            return name
        return f"{name}@{revision[:12] if re.fullmatch(r'[0-9a-f]{40}', revision) else revision.replace('/', '-')}"
    p = Path(path)
    try:
        is_dir = p.is_dir()
    except OSError:  # a name too long to look up is no directory either
        is_dir = False
    if is_dir or p.suffix != ".safetensors":
        return p.name
    return p.parent.name if p.stem == "adapter_model" else p.stem


def open_checkpoint(path: str | os.PathLike[str], name: str | None = None) -> Checkpoint:
    """The checkpoint at path with its header and config checked, its weights file held open so that every
    later read of it reads that one file; ValueError naming adapter and file. Close it when done (it is a
    context manager)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise refusal(name or "?", repr(path), [f"its path is a {type(path).__name__}, not a str or os.PathLike"])
    name = name or default_name(path)
    try:
        weights, config_path = locate_files(hub.resolve(path))
    except ValueError as e:
        raise refusal(name, path, [str(e)]) from None
    try:
        source = FileSource(weights)
    except OSError as e:
        raise refusal(name, weights, [f"cannot be opened ({e.strerror or e})"]) from None
    try:
        return _checkpoint(name, weights, config_path, source)
    except BaseException:
        source.close()
        raise


def _checkpoint(name: str, weights: Path, config_path: Path | None, source: FileSource) -> Checkpoint:
    try:
        header = read_header(source)
    except NotSafetensors as e:
        raise refusal(name, weights, [str(e)]) from None
    except (ValueError, OSError) as e:
        raise refusal(name, weights, [f"bad safetensors file: {e}"]) from None
    try:
        config = read_config(config_path) if config_path else None
    except (ValueError, OSError) as e:
        safetensors_header.forget(header)
        raise refusal(name, config_path, [str(e)]) from None
    if config is None:
        try:
            config = metadata_config(header)
        except ValueError as e:
            safetensors_header.forget(header)
            raise refusal(name, weights, [str(e)]) from None
    if config is None and any(k.startswith(PEFT_PREFIX) for k in header.tensors):
        safetensors_header.forget(header)
        why = f"a PEFT checkpoint with no {CONFIG} beside it, so its rank and alpha are unknown"
        raise refusal(name, weights, [why])
    return Checkpoint(name, weights, header, config, source=source)


def metadata_config(header: Header) -> AdapterConfig | None:
    """The transformer's LoraConfig, as diffusers' save_lora_weights writes it into the metadata."""
    raw = header.metadata.get(DIFFUSERS_METADATA)
    if raw is None:
        return None
    try:
        packed = json.loads(raw)
        if not isinstance(packed, dict):
            raise ValueError("not a JSON object")
        fields = {k.removeprefix("transformer."): v for k, v in packed.items() if k.startswith("transformer.")}
        return parse_config(fields, source=DIFFUSERS_METADATA) if fields else None
    except RecursionError:
        raise ValueError(f"{DIFFUSERS_METADATA} in its metadata nests too deeply to be a LoRA config") from None
    except ValueError as e:
        raise ValueError(f"{DIFFUSERS_METADATA} in its metadata is not a LoRA config ({e})") from None


class _Bytes:
    """A few tensors' bytes by their start, read as a file would be (what with_alphas reads alphas from)."""

    def __init__(self, values: Mapping[int, bytes], size: int) -> None:
        self.values, self.size = values, size

    def read(self, nbytes: int, at: int) -> bytes:
        return self.values.get(at, b"")[:nbytes]

    def close(self) -> None:
        pass
