"""Attention: grouped-query attention with FlashAttention's backward (the xla path), cuDNN's
fused kernel, the Pallas splash-attention kernel for TPU, context-parallel attention for a
sequence split over devices, the layer that projects to heads and back, and multi-head latent
attention (DeepSeek's MLA)."""

from podtrain.models.attention.kernels import splash_attention
from podtrain.models.attention.latent import LatentAttention
from podtrain.models.attention.module import Attention
from podtrain.models.attention.xla import causal_blocks, grouped_attention

__all__ = ["Attention", "LatentAttention", "causal_blocks", "grouped_attention", "splash_attention"]
