"""Token-mixer layers on generated kernels: `lrdsl.layers.GatedDeltaNet` (Qwen3.5's linear attention)."""
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetCache, GatedRMSNorm

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache", "GatedRMSNorm"]
