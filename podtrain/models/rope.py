"""Rotary position embeddings: the cos and sin tables at given positions, the stretches of their
frequencies for a longer context (linear, Llama 3's, YaRN), and the rotation itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Yarn:
    """YaRN's stretch of the rotary wavelengths (transformers' "yarn" rope type): wavelengths
    longer than the original context / beta_slow turns are divided by `factor`, those shorter than
    original / beta_fast kept, a linear ramp between; cos and sin are scaled by `attention_factor`
    (0: 0.1 ln(factor) + 1)."""

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    truncate: bool = True

    def __call__(self, inv_freq: jax.Array, theta: float) -> tuple[jax.Array, float]:
        dim = 2 * inv_freq.shape[0]

        def turns_at(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` in the context
            return dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = turns_at(self.beta_fast), turns_at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low if high != low else 0.001), 0, 1)
        attention = self.attention_factor or (0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp), attention


@dataclass(frozen=True)
class Linear:
    """Every frequency divided by `factor` (transformers' "linear" rope type)."""

    factor: float

    def __call__(self, inv_freq: jax.Array, theta: float) -> tuple[jax.Array, float]:
        return inv_freq / self.factor, 1.0


@dataclass(frozen=True)
class Llama3:
    """Llama 3's stretch for its longer context: wavelengths longer than original / low turns
    divided by `factor`, shorter than original / high kept, smoothly between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int

    def __call__(self, inv_freq: jax.Array, theta: float) -> tuple[jax.Array, float]:
        low, high = self.low_freq_factor, self.high_freq_factor
        smooth = jnp.clip((self.original_max_len * inv_freq / (2 * jnp.pi) - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv_freq / self.factor + smooth * inv_freq, 1.0


def rope_tables(positions, head_dim: int, theta: float, scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape (..., head_dim // 2) for rotary position embeddings at `positions`
    (an int n: 0..n-1; or an array, (seq,) or (batch, seq)). `scaling` (Linear, Llama3, Yarn: the
    inverse frequencies and theta -> stretched ones and a factor on cos and sin) stretches them
    for a longer context."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    inv_freq, attention = (inv_freq, 1.0) if scaling is None else scaling(inv_freq, theta)
    positions = jnp.arange(positions) if isinstance(positions, int) else positions
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))
    if attention == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * attention, jnp.sin(angles) * attention


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate (batch, seq, heads, head_dim) by position, in the half-split layout of Llama. Tables
    narrower than head_dim / 2 rotate only the first 2 x their width dimensions (partial rotary, Phi-3)."""
    cos, sin = (t[..., None, :] if t.ndim == 3 else t[None, :, None, :] for t in rope)  # per row, or shared
    rotary = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return rotated if rotary == x.shape[-1] else jnp.concatenate([rotated, x[..., rotary:]], axis=-1)
