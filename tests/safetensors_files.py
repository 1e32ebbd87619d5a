"""safetensors files as other writers may lay them out, and what a file's header says, for tests that rewrite
adapters' files."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from tiny import SAFETENSORS_DTYPES


def write_by_hand(file: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str],
                  header_length_mod_8: int = 0) -> None:
    """A safetensors file with its tensors laid out in the order given, and a header padded with spaces to a
    length of header_length_mod_8 modulo 8 (safetensors pads to 0; the format allows any), as a writer other
    than safetensors' own may write it."""
    header, at = {"__metadata__": metadata}, 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * ((header_length_mod_8 - len(text)) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, t in tensors:
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def data_start(blob: bytes) -> int:
    """Where the tensors' bytes start in a file whose bytes (or first bytes) are blob."""
    return 8 + int.from_bytes(blob[:8], "little")


def header(file: Path) -> dict:
    with open(file, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def file_order(file: Path) -> list[str]:
    """The file's tensors in the order their bytes lie."""
    entries = header(file)
    entries.pop("__metadata__", None)
    return sorted(entries, key=lambda k: entries[k]["data_offsets"][0])


def load(file: Path) -> dict[str, torch.Tensor]:
    """The file's tensors, copied out of its mapping: the file may be rewritten next."""
    return {k: v.clone() for k, v in safetensors.torch.load_file(file).items()}


def metadata(file: Path) -> dict[str, str]:
    with safetensors.safe_open(file, "pt") as f:
        return f.metadata()
