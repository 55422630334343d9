"""Building blocks shared by the models. Parameters and activations name logical axes; the mesh
is reached only by name (`constrain` pins an activation, and the rules decide what that means);
a layer stack runs through `pipeline.run_stack`, which makes it a pipeline where the mesh has a
`stage` axis.

Precision policy: parameters are stored in float32 and cast to the compute dtype where used;
norms, softmax statistics and logits are computed in float32.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models import fused_mlp, lora, ops
from podtrain.models.pipeline import run_stack
from podtrain.sharding import constrain

ACT = ("act_batch", "act_seq", "act_embed")  # the residual stream (batch, seq, d_model)
HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_HEADS = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
LOGITS = ("act_batch", "act_seq", "act_vocab")
SEGMENTS = ("act_batch", "act_seq")  # per token: its document's id, or its position
# Embedding tables and output heads in use: gathered over fsdp, split over the vocabulary under tensor.
TABLE, HEAD = ("act_vocab", "act_embed"), ("act_embed", "act_vocab")


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of a (vocab, embed) table laid out as TABLE for (batch, seq) tokens: a lookup local
    to each batch shard (vocab-parallel under tensor: masked rows, then one all-reduce)."""
    return constrain(jnp.take(table, tokens, axis=0), ACT)


def output_head(x: jax.Array, head: jax.Array, dtype) -> jax.Array:
    """Logits of x (..., embed) through an (embed, vocab) head laid out as HEAD: inputs in the
    compute dtype, accumulated and returned in float32 (MaxText's logits_dot_in_fp32)."""
    return constrain(ops.logits_dot(x.astype(dtype), head.astype(dtype)), LOGITS)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> nnx.Param:
    """A float32 normal(0, std) parameter tagged with its logical axis names."""
    return nnx.Param(
        std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False
    )


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, computed in float32; no learned scale."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_norm_keeping_input(x: jax.Array, eps: float) -> jax.Array:
    """rms_norm whose backward keeps x in its own dtype (bfloat16 under mixed precision) and the
    (..., 1) float32 scale, where autodiff keeps x's float32 copy: the float32 copy of a bfloat16
    value is exact, so the backward reads half the bytes for the same numbers."""
    return rms_norm(x, eps)


def _rms_norm_keeping_input_fwd(x, eps):
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * scale, (x, scale)


def _rms_norm_keeping_input_bwd(eps, residuals, d_y):
    x, scale = residuals
    y = x.astype(jnp.float32) * scale
    d_y = d_y.astype(jnp.float32)
    return ((scale * (d_y - y * jnp.mean(d_y * y, axis=-1, keepdims=True))).astype(x.dtype),)


rms_norm_keeping_input.defvjp(_rms_norm_keeping_input_fwd, _rms_norm_keeping_input_bwd)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, whose logical name is `axis`. With `plus_one` the
    scale is 1 + w, w starting at 0 (Gemma's norms)."""

    def __init__(self, dim: int, eps: float, axis: str = "embed", plus_one: bool = False):
        start = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(start((dim,), jnp.float32), out_sharding=(axis,), eager_sharding=False)
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.scale[...] + 1 if self.plus_one else self.scale[...]
        scale = jnp.expand_dims(scale, tuple(range(x.ndim - 1)))  # (1, ..., 1, dim)
        return (rms_norm(x, self.eps) * scale).astype(x.dtype)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of (..., 2, d_ff), gate first. The gradient of both halves is written in one
    pass; taking the halves as slices would write each padded to full size and then add them."""
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jax.nn.silu(gate) * up


def _swiglu_bwd(gate_up, d_hidden):
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    sig = jax.nn.sigmoid(gate)
    return (jnp.stack([d_hidden * up * sig * (1 + gate * (1 - sig)), d_hidden * gate * sig], axis=-2),)


swiglu.defvjp(lambda gate_up: (swiglu(gate_up), gate_up), _swiglu_bwd)


def _gate_up(x, w_in, x_axes):
    """x's gate and up pre-activations (..., 2, d_ff): one matmul, so that the gradient reaches x
    through one all-reduce."""
    return constrain(ops.dot("...d,dkf->...kf", x, w_in, w_in.dtype), (*x_axes[:-1], None, "act_mlp"))


def _mlp_hidden(x, w_in, x_axes):
    gate_up = _gate_up(x, w_in, x_axes)
    return gate_up, swiglu(gate_up)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def swiglu_mlp(x: jax.Array, w_in: jax.Array, w_down: jax.Array, x_axes: tuple[str, ...]) -> jax.Array:
    """swiglu(x w_in) w_down, w_in (d, 2, d_ff) gate first, whose backward keeps only its inputs: the
    (..., 2, d_ff) pre-activations and the hidden layer are computed again from x there instead of
    being written to memory, stacked per layer and read back. The same operations as SwiGLU's plain
    path forward; its gradients are autodiff's to rounding."""
    return ops.dot("...f,fd->...d", _mlp_hidden(x, w_in, x_axes)[1], w_down, w_down.dtype)


def _swiglu_mlp_fwd(x, w_in, w_down, x_axes):
    return swiglu_mlp(x, w_in, w_down, x_axes), (x, w_in, w_down)


def _swiglu_mlp_bwd(x_axes, residuals, d_out):
    x, w_in, w_down = residuals
    gate_up, hidden = _mlp_hidden(x, w_in, x_axes)
    batch = "".join(chr(ord("a") + i) for i in range(x.ndim - 1))  # the leading axes, summed for the weights
    d_w_down = jnp.einsum(f"{batch}f,{batch}d->fd", hidden, d_out)
    d_hidden = constrain(d_out @ w_down.T, (*x_axes[:-1], "act_mlp"))
    d_gate_up = _swiglu_bwd(gate_up, d_hidden)[0]
    d_x = jnp.einsum("...kf,dkf->...d", d_gate_up, w_in)
    d_w_in = jnp.einsum(f"{batch}d,{batch}kf->dkf", x, d_gate_up)
    return d_x, d_w_in, d_w_down


swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down over the last axis, whose logical name is `axis` for the
    weights; `x_axes` names x's axes. Column- then row-parallel over mlp: one all-reduce under tensor parallelism.
    With `recompute` the backward keeps only x and computes the hidden layer again (`swiglu_mlp`);
    with `kernel="pallas"` (TPU) one Pallas kernel keeps that layer in VMEM (`fused_mlp`); both
    multiply in the compute dtype, so a low-precision policy (models/ops.py) takes the plain path.
    With activation="gelu_tanh" it is GeGLU (Gemma), differentiated by autodiff, as are LoRA's adapters."""

    adaptable = {"w_gate": 1, "w_up": 1, "w_down": 1}  # for LoRA (models/lora.py): each weight's input axes

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        std: float,
        out_std: float,
        dtype,
        rngs: nnx.Rngs,
        axis: str = "embed",
        x_axes: tuple[str, ...] = ACT,
        recompute: bool = False,
        kernel: str = "xla",
        activation: str = "silu",
    ):
        self.w_gate = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_up = param(rngs, (d_model, d_ff), (axis, "mlp"), std)
        self.w_down = param(rngs, (d_ff, d_model), ("mlp", axis), out_std)
        self.dtype, self.x_axes, self.recompute, self.kernel = dtype, x_axes, recompute, kernel
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        w_in = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(self.dtype)  # (d, 2, d_ff)
        w_down = self.w_down[...].astype(self.dtype)
        low_rank = lora.adapted(self)
        plain = low_rank or self.activation != "silu" or ops.narrow()
        if self.kernel == "pallas" and not plain and fused_mlp.fits(self.x_axes, *w_down.shape[::-1]):
            return constrain(fused_mlp.fused_swiglu_mlp(x, w_in, w_down, self.x_axes), self.x_axes)
        if self.recompute and not plain:
            return constrain(swiglu_mlp(x, w_in, w_down, self.x_axes), self.x_axes)
        gate_up = _gate_up(x, w_in, self.x_axes)
        if low_rank:  # autodiff's backward: the adapters' terms join the plain path
            terms = [lora.low_rank(self, name, x, self.dtype) for name in ("w_gate", "w_up")]
            gate_up = gate_up + jnp.stack([jnp.zeros_like(gate_up[..., 0, :]) if t is None else t for t in terms], -2)
            gate_up = constrain(gate_up, (*self.x_axes[:-1], None, "act_mlp"))
        if self.activation == "gelu_tanh":  # GeGLU (Gemma): autodiff's backward, none of silu's kernels
            hidden = jax.nn.gelu(gate_up[..., 0, :], approximate=True) * gate_up[..., 1, :]
        else:
            hidden = swiglu(gate_up)
        out = ops.dot("...f,fd->...d", hidden, w_down, self.dtype)
        if (term := lora.low_rank(self, "w_down", hidden, self.dtype)) is not None:
            out = out + term
        return constrain(out, self.x_axes)


# What a layer marks with `checkpoint_name(x, KEPT)` is cheaper kept than recomputed, and remat
# full keeps it: mHC's branch inputs and outputs and its mixing projection (models/mhc.py).
KEPT = "kept_under_remat"
# model.remat -> what the backward keeps of a layer's forward (None: everything, no recomputation),
# in order of the memory they save and the recomputation they cost
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(ops.PRODUCT),
    ),
    "full": jax.checkpoint_policies.save_only_these_names(KEPT),
}


def scan_layers(
    layers: nnx.Module,
    x,
    *args,
    per_layer: tuple = (),
    remat: str = "none",
    unroll: int | str = 1,
    precision: str = "compute",
    decode: bool = False,
    unbatched: tuple[int, ...] = (),
) -> tuple[Any, Any]:
    """Run a stack of identical layers (created with `nnx.vmap`) over x with `lax.scan`: each
    layer is called with x, `args`, then its own slice of each array in `per_layer` (layers, ...).
    Returns x and the layers' reports, stacked (layers, ...): a layer class with `reports = True`
    returns (x, report) (an MoE layer's routing statistics); else None. With `decode` each layer's
    `decode` runs instead, and its report is its part of the cache.

    Compile time stays independent of depth; `remat` trades recomputation for activation memory;
    the weights' matmuls run under `precision` (models/ops.py).
    `unroll` layers per iteration; `auto` that no runtime resolved (a model built by hand) scans.
    The scan runs through `pipeline.run_stack`, a pipeline on a mesh with a `stage` axis (not when
    decoding), which cuts each of `args` into microbatches along its batch axis (batch, ...) but
    those at the indices `unbatched`, the same for every example (a RoPE table of shared positions).
    """
    graphdef, state = nnx.split(layers)
    unroll = 1 if unroll == "auto" else unroll

    def run(state, h, args, per_layer):
        def body(h, layer):
            layer_state, own, index = layer
            module = nnx.merge(graphdef, layer_state)
            with lora.layer(index), ops.policy(precision):
                out = (module.decode if decode else module)(h, *args, *own)
            return out if decode or getattr(module, "reports", False) else (out, None)

        if (kept := REMAT_POLICIES[remat]) is not None:
            # Without CSE's guard a rolled scan stays right (one layer per iteration) and compiles
            # leaner; unrolled, XLA would merge the recomputation back into the forward pass.
            body = jax.checkpoint(body, policy=kept, prevent_cse=unroll != 1)
        indices = jnp.arange(jax.tree.leaves(state)[0].shape[0])
        return jax.lax.scan(body, h, (state, per_layer, indices), unroll=unroll)

    return run_stack(run, state, x, args, per_layer, decode, unbatched)


def stacked(n: int, make, rngs: nnx.Rngs) -> nnx.Module:
    """n independently initialised copies of `make(rngs)`, stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return make(rngs)

    return create(rngs)
