"""Checkpoint keys to (module, role): the PEFT layout's key conversion."""

from __future__ import annotations

import functools

PEFT_PREFIX = "base_model.model."

# Suffixes PEFT writes after a module name, and the role each gives. Only A and B are served;
# the other roles are named so that a refusal can say what the weight is.
_SUFFIXES = (
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".lora_B.bias", "lora_bias"),
    (".lora_A.bias", "lora_bias"),
    (".lora_magnitude_vector.weight", "dora"),
    (".lora_magnitude_vector", "dora"),
    (".lora_embedding_A", "embedding"),
    (".lora_embedding_B", "embedding"),
    (".token_adapter.trainable_tokens_delta", "tokens"),
    (".bias", "bias"),
    (".weight", "weight"),
)

ROLE_REASONS = {
    "lora_bias": "a LoRA bias (lora_bias) is not served",
    "dora": "a DoRA magnitude vector: DoRA is not served",
    "embedding": "LoRA on an embedding is not served",
    "tokens": "trainable token rows are not served",
    "bias": "a trained bias is not served",
    "weight": "a whole weight (modules_to_save) is not served",
    "unknown": "not a LoRA weight this pool knows",
}


@functools.lru_cache(maxsize=1 << 16)
def peft_keys(key: str) -> tuple[str, str]:
    """(module, role) of a PEFT checkpoint key; module is named less PEFT's base_model.model."""
    name = key.removeprefix(PEFT_PREFIX)
    for suffix, role in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], role
    return name, "unknown"
