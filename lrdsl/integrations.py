"""Drop lrdsl into transformers models.

    model = AutoModelForCausalLM.from_pretrained(...)      # a Qwen3.5 model
    lrdsl.integrations.patch_qwen35(model)                 # its linear-attention layers now run on lrdsl
    lrdsl.integrations.unpatch(model)                      # back to transformers' own layers

The patched layers hold the model's own Parameter objects (nothing is copied), so training,
saving, loading and moving the model work as before, and unpatch needs no copying either.
"""
from __future__ import annotations

from torch import nn

from .errors import LrdslError
from .layers import GatedDeltaNet

# The attribute of a Qwen3.5 decoder layer that holds its linear-attention module.
LINEAR_ATTENTION_ATTRIBUTE = "linear_attn"
# Where a patched layer keeps the module it replaced: a tuple, so nn.Module does not register
# it as a submodule (its parameters would be listed twice).
_ORIGINAL = "_lrdsl_replaced"


def _linear_attention_owners(model: nn.Module):
    return [module for module in model.modules() if isinstance(getattr(module, LINEAR_ATTENTION_ATTRIBUTE, None), nn.Module)]


def patch_qwen35(model: nn.Module) -> nn.Module:
    """Run every Qwen3.5 linear-attention layer of `model` on lrdsl's kernels (in place; returns model)."""
    if not isinstance(model, nn.Module):
        raise LrdslError(f"patch_qwen35: expected a torch.nn.Module, got {type(model).__name__}")
    owners = _linear_attention_owners(model)
    if not owners:
        raise LrdslError(f"patch_qwen35: {type(model).__name__} has no '{LINEAR_ATTENTION_ATTRIBUTE}' layers (not a Qwen3.5 model?)")
    for owner in owners:
        original = getattr(owner, LINEAR_ATTENTION_ATTRIBUTE)
        if isinstance(original, GatedDeltaNet):
            continue  # patched already
        patched = GatedDeltaNet.sharing_parameters_of(original)
        setattr(patched, _ORIGINAL, (original,))
        setattr(owner, LINEAR_ATTENTION_ATTRIBUTE, patched)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the layers patch_qwen35 replaced (in place; returns model). A model never patched
    is returned unchanged."""
    for owner in _linear_attention_owners(model):
        patched = getattr(owner, LINEAR_ATTENTION_ATTRIBUTE)
        if isinstance(patched, GatedDeltaNet) and hasattr(patched, _ORIGINAL):
            (original,) = getattr(patched, _ORIGINAL)
            setattr(owner, LINEAR_ATTENTION_ATTRIBUTE, original.train(patched.training))
    return model
