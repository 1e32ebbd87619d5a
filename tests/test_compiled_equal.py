"""The compiled read gives, byte for byte, what the read before it gave: every layout the suite reads (PEFT's
dense adapters at mixed ranks and scalings, bf16 files cast and not, a vision tower beside its language
model, stacked and per-expert experts, diffusers' and the trainers' layouts with alpha tensors, SDXL's
convs, pushes from memory, a per-expert header of 24,576 tensors and copies of it each wrong in one
module), on every rank of world sizes 1, 2, 4 and 8, without a digest, with one, and again with it
(fingerprints); the check's digest too, and every refusal's words. The reference is this package as it
was at REFERENCE, taken from git and run in a process of its own (compiled_reference.py). (~90 s.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from compiled_reference import read_cases
from safetensors.torch import load_file, save_file

REFERENCE = "53cd868"  # the commit before the compiled read
REPO = Path(__file__).resolve().parent.parent
WORLD_SIZES = (1, 2, 4, 8)


def _reference_src(root: Path) -> Path:
    """The package's src at REFERENCE, unpacked under root (MSTAR_REFERENCE_SRC names one already there)."""
    given = os.environ.get("MSTAR_REFERENCE_SRC")
    if given:
        return Path(given)
    archive = root / "ref.tar"
    try:
        with archive.open("wb") as f:
            subprocess.run(["git", "-C", str(REPO), "archive", REFERENCE, "src/mstar"], stdout=f, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the reference commit {REFERENCE} is not in this checkout's git ({e})")
    with tarfile.open(archive) as t:
        t.extractall(root / "ref", filter="data")
    return root / "ref" / "src"


def _cases(root: Path) -> list[dict]:
    from diffusion import FLUX, WAN, WAN_TARGETS, native, save_flux_lora, save_wan_lora
    from diffusion_models import SDXL_UNET
    from moe import CONFIGS, MANY, many_experts_variants, per_expert_adapter, stacked_adapter
    from test_sdxl_kohya import kohya_file
    from tiny import LM_TARGETS, make_adapter, model_config

    cases = []

    def add(config, path, spec, sizes=WORLD_SIZES, dtypes=("float32",), push=False):
        for ws in sizes:
            for dtype in dtypes:
                cases.append({"config": config, "path": str(path), "spec": spec, "world_size": ws, "dtype": dtype,
                              "push": push})

    llama = model_config("llama")
    _, mixed = make_adapter(root, name="mixed", config=llama, rank_pattern={"down_proj": 2, "k_proj": 8},
                            alpha_pattern={"o_proj": 5})
    add(llama, mixed, {"max_rank": 8}, dtypes=("float32", "bfloat16"))
    add(llama, mixed, {"max_rank": 8}, sizes=(1, 2), push=True)
    _, bf16 = make_adapter(root, name="bf16", config=llama, dtype=torch.bfloat16, r=8, lora_alpha=16)
    add(llama, bf16, {"max_rank": 8}, dtypes=("float32", "bfloat16"))
    add(llama, bf16, {"max_rank": 16}, sizes=(1, 4), dtypes=("bfloat16",))
    # wide enough that a row target's A shard has rows of 1 KiB and more, read row by row (plan.SHARD_ROW)
    wide = model_config("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8,
                        num_key_value_heads=8, head_dim=64)
    _, wide_path = make_adapter(root, name="wide", config=wide, rank_pattern={"o_proj": 2}, alpha_pattern={"o_proj": 3})
    add(wide, wide_path, {"max_rank": 4}, dtypes=("float32", "bfloat16"))
    _, wide_bf16 = make_adapter(root, name="wide-bf16", config=wide, dtype=torch.bfloat16)
    add(wide, wide_bf16, {"max_rank": 4}, dtypes=("bfloat16",))
    vl = model_config("qwen2_vl", num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    _, vl_path = make_adapter(root, "qwen2_vl", name="vl", config=vl,
                              target_modules=[*LM_TARGETS, "qkv", "proj", "fc1", "fc2"], alpha_pattern={"o_proj": 3})
    add(vl, vl_path, {"max_rank": 8})
    for family in ("qwen3_moe", "gpt_oss"):
        _, stacked = stacked_adapter(root, family, name=f"stacked-{family}", lora_alpha=3)
        add(CONFIGS[family], stacked, {"max_rank": 8, "max_expert_rank": 4})
    for family in ("qwen3_moe", "mixtral"):
        _, pe = per_expert_adapter(root, family, name=f"pe-{family}")
        add(CONFIGS[family], pe, {"max_rank": 8, "max_expert_rank": 4})
        add(CONFIGS[family], pe, {"max_rank": 8, "max_expert_rank": 2}, sizes=(1, 2), dtypes=("bfloat16",))
    _, some = per_expert_adapter(root, "qwen3_moe", name="pe-some", experts=[1, 3], r=3, alpha=5)
    add(CONFIGS["qwen3_moe"], some, {"max_rank": 8, "max_expert_rank": 4}, sizes=(1, 4))
    add(CONFIGS["qwen3_moe"], some, {"max_rank": 8, "max_expert_rank": 2}, sizes=(1,))  # refused: rank 3
    wan = save_wan_lora(root / "wan", target_modules=WAN_TARGETS)
    add(WAN, wan, {"max_rank": 8}, sizes=(1, 2))
    for style in ("native", "kohya"):
        add(WAN, native(wan, root / f"{style}.safetensors", style), {"max_rank": 8}, sizes=(1, 2))
    add(WAN, native(wan, root / "int.safetensors", "kohya", alpha_dtype=torch.int64), {"max_rank": 8}, sizes=(1,))
    add(FLUX, save_flux_lora(root / "flux"), {"max_rank": 8}, sizes=(1, 2))
    add(SDXL_UNET, kohya_file(root / "sdxl.safetensors"), {"max_rank": 4}, sizes=(1, 2))
    lacking = root / "lacking"  # a module without its B: refused, though its host bytes come first
    lacking.mkdir()
    tensors = load_file(mixed / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("layers.1.self_attn.q_proj.lora_B.weight")},
              lacking / "adapter_model.safetensors")
    (lacking / "adapter_config.json").write_text((mixed / "adapter_config.json").read_text())
    add(llama, lacking, {"max_rank": 8}, sizes=(1, 2))
    many = {**CONFIGS["qwen3_moe"], **MANY}  # thousands of modules of a few templates, one wrong in each copy
    for path, _, _ in many_experts_variants(root / "many").values():
        add(many, path, {"max_rank": 8, "max_expert_rank": 4}, sizes=(1,))
    return cases


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    cases = _cases(root)
    (root / "cases.json").write_text(json.dumps(cases))
    src = _reference_src(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(Path(__file__).parent)])}
    subprocess.run([sys.executable, str(Path(__file__).parent / "compiled_reference.py"), str(root / "cases.json"),
                    str(root / "ref.pt")], env=env, check=True, cwd=root)
    ref = torch.load(root / "ref.pt")
    assert Path(ref["mstar"]).resolve().is_relative_to(src.resolve()), "the reference ran the reference's code"
    return cases, ref["answers"], read_cases(cases)


def _differences(want: dict, got: dict, where: str) -> list[str]:
    out = []
    for key in sorted(set(want) | set(got)):
        w, g = want.get(key), got.get(key)
        if isinstance(w, dict) or isinstance(g, dict):
            out += _differences(w or {}, g or {}, f"{where} {key}")
        elif isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor):
            if w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g):
                out.append(f"{where} {key}: bytes differ")
        elif w != g:
            out.append(f"{where} {key}: {w!r} != {g!r}")
    return out


def test_the_compiled_read_is_the_reference_byte_for_byte(answers):
    cases, want, got = answers
    assert len(want) == len(got) == len(cases)
    differ = []
    for case, w, g in zip(cases, want, got, strict=True):
        differ += _differences(w, g, f"{Path(case['path']).name} ws={case['world_size']} {case['dtype']}"
                                     f"{' push' if case['push'] else ''}")
    assert not differ, "\n".join(differ[:40])


def test_the_cases_read_and_refuse_what_they_should(answers):
    """The comparison compares copies, not refusals alone: most cases read, one refuses, digests are kept."""
    cases, want, _ = answers
    reads = [v for w in want for k, v in w.items() if k != "check" and "refused" not in v]
    refused = [v for w in want for k, v in w.items() if "refused" in v]
    assert len(reads) > 300 and refused, (len(reads), len(refused))
    wrong = [Path(c["path"]).parent.name == "many" and Path(c["path"]).name != "plain" for c in cases]
    assert all("refused" in w["check"] for w, bad in zip(want, wrong, strict=True) if bad) and sum(wrong) >= 10
    assert sum("digest" in w["check"] for w in want) >= len(want) - 3 - sum(wrong)
    assert all("bytes" in v for w in want for k, v in w.items() if k.endswith("host_bytes"))
