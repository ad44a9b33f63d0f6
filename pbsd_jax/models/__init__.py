"""Decoder-only transformer, KV cache and Hugging Face interop."""

from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.transformer import (KVCache, ModelOutput, Transformer, init_params,
                                         param_axes, param_shapes, param_shardings,
                                         positions_from_mask)

__all__ = ["ModelConfig", "KVCache", "ModelOutput", "Transformer", "init_params", "param_axes",
           "param_shapes", "param_shardings", "positions_from_mask"]
