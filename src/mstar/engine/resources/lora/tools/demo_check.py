"""The demo's proof: every request's tokens generated again by PEFT with that request's adapter version."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from .engine import Job
from .table import table


def peft_tokens(model: torch.nn.Module, job: Job, device: torch.device) -> tuple[list[int], float]:
    """Greedy generation of job's tokens by model (a PeftModel or the base model), and the smallest gap
    between its two best logits at any token: how close a rounding difference came to another token."""
    ids = torch.tensor([job.prompt], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=job.wants,
                             min_new_tokens=job.wants, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    gaps = [float(t[0] - t[1]) for t in (logits[0].float().topk(2).values for logits in out.logits)]
    return out.sequences[0, len(job.prompt):].tolist(), min(gaps)


def check_against_peft(jobs: list[Job], folders: Mapping[bytes, tuple[str, Path]],
                       base_model: Callable[[], torch.nn.Module], device: torch.device) -> bool:
    """Each job that ran, generated again by PEFT: the base model for a base-model request, else the base
    model with the folder of the version it was admitted with loaded by peft.PeftModel. Prints a row per
    version (how many tokens equal PEFT's, and how many differ from the base model's, which is what
    shows the adapter mattered); True when every token is PEFT's."""
    import peft

    ran = [j for j in jobs if j.error is None]
    base = base_model()
    rows, worst_gap, mismatched = [], float("inf"), []
    for digest in dict.fromkeys(j.digest for j in ran):
        group = [j for j in ran if j.digest == digest]
        name, folder = folders[digest] if digest is not None else ("(base model)", None)
        model = base if folder is None else peft.PeftModel.from_pretrained(base_model(), folder).eval()
        same = differ = 0
        for j in group:
            want, gap = peft_tokens(model, j, device)
            plain = want if folder is None else peft_tokens(base, j, device)[0]
            worst_gap = min(worst_gap, gap)
            same += sum(a == b for a, b in zip(j.tokens, want, strict=False))  # PEFT might stop early
            differ += sum(a != b for a, b in zip(j.tokens, plain, strict=False))
            if j.tokens != want:
                mismatched.append(f"{j.id} ({name}): ran {j.tokens}, PEFT generates {want}")
        tokens = sum(len(j.tokens) for j in group)
        rows.append({"adapter": name, "version": digest.hex()[:8] if digest else "-",
                     "requests": " ".join(j.id for j in group), "tokens": tokens, "= PEFT's": same,
                     "≠ base model's": differ if folder is not None else "-"})
    print(table(rows, ["adapter", "version", "requests", "tokens", "= PEFT's", "≠ base model's"]))
    print(f"closest call: PEFT's best two logits were {worst_gap:.1e} apart at the nearest (fp32 rounding is ~1e-6)")
    for line in mismatched:
        print("MISMATCH", line)
    return not mismatched
