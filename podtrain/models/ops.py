"""Every weight's matmul, in one place: `dot` contracts an activation with a weight by an einsum,
in the compute dtype, under the precision policy of the layers it runs in (`policy`, which
`scan_layers` sets around a layer stack from `model.matmul_precision`):

- "compute": operands and result in the compute dtype (bfloat16 on accelerators), as autodiff
  differentiates it;
- "fp8": both operands scaled into float8 e4m3, the backward's output gradient into e5m2 (its
  wider range), each product accumulated in float32 and scaled back: what Hopper GPUs multiply at
  twice their bfloat16 rate;
- "int8": both operands rounded to int8, accumulated in int32: what TPU v5e, v5p and v6e multiply
  at twice their bfloat16 rate.

Scaling is current: each operand is divided by its largest magnitude over the format's largest
value, computed where it is used, so no scaling state is kept between steps and a resumed run
scales as the uninterrupted one. fp8 scales per tensor: the backward reuses the forward's
quantized operands and quantizes the output gradient once for both of its products. int8 scales
per row (per token of an activation, per output channel of a weight, along each product's own
contraction), as AQT does: with one scale per tensor its 255 levels lost small rows to a large
one (the tiny recipe's held-out loss 6% above the compute dtype's). Weights stay float32 masters.
The embeddings, the output head (`logits_dot`) and the MoE router are outside the layer stacks and
stay in the compute dtype, as do the experts' grouped matmuls (`grouped_matmul`: XLA's ragged_dot
or the megablox kernel), whose kernels take no narrow formats here.
"""

from __future__ import annotations

import contextvars
import string
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox


@dataclass(frozen=True)
class Format:
    """A quantized policy's formats: of the forward's operands and of the backward's output
    gradient, and its scaling: per row (int8's 255 levels lose small rows to one large one) or per
    tensor (fp8's exponent keeps them, and a tensor's one scale lets the backward reuse the
    forward's operands)."""

    operands: Any
    gradient: Any
    rows: bool


# model.matmul_precision -> its format (None: the compute dtype, no quantization)
PRECISIONS = {
    "compute": None,
    "fp8": Format(jnp.float8_e4m3fn, jnp.float8_e5m2, rows=False),
    "int8": Format(jnp.int8, jnp.int8, rows=True),
}
PRODUCT = "narrow_matmul"  # the name of a quantized product's output
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("podtrain_matmul_precision", default="compute")


@contextmanager
def policy(name: str):
    """Weights' matmuls traced inside run under precision policy `name` (model.matmul_precision's)."""
    token = _POLICY.set(name)
    try:
        yield
    finally:
        _POLICY.reset(token)


def narrow() -> bool:
    """Whether the policy in force quantizes the weights' matmuls (is not the compute dtype's)."""
    return PRECISIONS[_POLICY.get()] is not None


def dot(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """einsum(spec, x, w) of an activation x and a weight w, both cast to `dtype`, under the policy
    in force; the result is in `dtype`."""
    x, w = x.astype(dtype), w.astype(dtype)
    name = _POLICY.get()
    if PRECISIONS[name] is None:
        return jnp.einsum(spec, x, w)
    # Named for remat's "dots" policy, which sees a custom_vjp's output as no matmul's.
    return checkpoint_name(_quantized(_explicit(spec, x.ndim, w.ndim), name, x, w), PRODUCT)


def _parts(spec: str) -> tuple[str, str, str]:
    """An einsum spec's (first operand, second operand, output) letters."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return a, b, out


def _explicit(spec: str, x_ndim: int, w_ndim: int) -> str:
    """`spec` with the ellipsis of its activation spelled out in letters it does not use: the
    backward's specs contract over those axes."""
    if "..." not in spec:
        return spec
    x_in, w_in, _ = _parts(spec)
    operand, ndim = (x_in, x_ndim) if "..." in x_in else (w_in, w_ndim)
    free = [c for c in string.ascii_letters if c not in spec]
    return spec.replace("...", "".join(free[: ndim - len(operand.replace("...", ""))]))


def _quantize(x: jax.Array, letters: str, kept: str, dtype, rows: bool) -> tuple[jax.Array, jax.Array]:
    """x (axes `letters`) in `dtype` and its float32 scale (x ~ q * scale), the largest magnitude
    mapped to the format's largest value: per tensor, or with `rows` per index of the axes in
    `kept` (those the product keeps), the scale with size 1 on the others."""
    top = float(jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).max)
    over = tuple(i for i, c in enumerate(letters) if c not in kept or not rows)
    amax = jnp.max(jnp.abs(x), axis=over, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = x.astype(jnp.float32) / scale
    q = jnp.clip(jnp.round(q), -top, top) if jnp.issubdtype(dtype, jnp.integer) else q
    return q.astype(dtype), scale


def _product(spec: str, a: tuple, b: tuple, dtype) -> jax.Array:
    """einsum(spec) of quantized operands (q, scale) times their scales, in `dtype`: fp8
    accumulates in float32 inside the matmul and writes `dtype`; int8 accumulates in int32."""
    a_in, b_in, out = _parts(spec)
    written = jnp.int32 if jnp.issubdtype(a[0].dtype, jnp.integer) else dtype
    product = jnp.einsum(spec, a[0], b[0], preferred_element_type=written).astype(dtype)
    return product * (_in_layout(a[1], a_in, out) * _in_layout(b[1], b_in, out)).astype(dtype)


def _in_layout(scale: jax.Array, letters: str, out: str) -> jax.Array:
    """An operand's scales (size 1 on the axes they do not vary along) broadcastable against the
    product, whose axes are `out`."""
    kept = [c for c in letters if c in out]
    rows = scale.reshape([n for n, c in zip(scale.shape, letters) if c in out])
    rows = jnp.transpose(rows, sorted(range(len(kept)), key=lambda i: out.index(kept[i])))
    ordered = sorted(kept, key=out.index)
    return rows.reshape([rows.shape[ordered.index(c)] if c in ordered else 1 for c in out])


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized(spec: str, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return _quantized_fwd(spec, name, x, w)[0]


def _quantized_fwd(spec, name, x, w):
    operands, rows = PRECISIONS[name].operands, PRECISIONS[name].rows
    x_in, w_in, out = _parts(spec)
    qx, qw = _quantize(x, x_in, out, operands, rows), _quantize(w, w_in, out, operands, rows)
    # Per tensor the backward reuses the quantized operands: half the bytes of x and w kept, no
    # second pass; per row it scales them again along its own products' rows.
    return _product(spec, qx, qw, x.dtype), (x, w) if rows else (qx, qw)


def _quantized_bwd(spec, name, saved, d_out):
    operands, gradient = PRECISIONS[name].operands, PRECISIONS[name].gradient
    x_in, w_in, out = _parts(spec)
    if PRECISIONS[name].rows:
        x, w = saved
        qd_x, qw = _quantize(d_out, out, x_in, gradient, True), _quantize(w, w_in, x_in, operands, True)
        qx, qd_w = _quantize(x, x_in, w_in, operands, True), _quantize(d_out, out, w_in, gradient, True)
    else:
        (qx, qw), qd_x = saved, _quantize(d_out, out, "", gradient, False)
        qd_w = qd_x
    d_x = _product(f"{out},{w_in}->{x_in}", qd_x, qw, d_out.dtype)
    d_w = _product(f"{x_in},{out}->{w_in}", qx, qd_w, d_out.dtype)
    return d_x, d_w


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


@jax.custom_vjp
def logits_dot(x: jax.Array, head: jax.Array) -> jax.Array:
    """x @ head in float32 (MaxText's logits_dot_in_fp32). Its backward takes the logits' gradient
    in the inputs' dtype, as every other matmul's backward does: autodiff would keep it in float32
    and run both gradient matmuls in float32 (TF32 on a GPU: 14 ms of the 1B recipe's 248 ms step
    on an H200)."""
    return jnp.matmul(x, head, preferred_element_type=jnp.float32)


def _logits_dot_fwd(x: jax.Array, head: jax.Array):
    return logits_dot(x, head), (x, head)


def _logits_dot_bwd(saved, d_logits: jax.Array):
    x, head = saved
    d_logits = d_logits.astype(x.dtype)
    return d_logits @ head.T, jnp.einsum("...e,...v->ev", x, d_logits)


logits_dot.defvjp(_logits_dot_fwd, _logits_dot_bwd)


def grouped_matmul(lhs, rhs, sizes, kernel: str = "ragged_dot", interpret: bool = False, rows: int = 0) -> jax.Array:
    """Rows lhs (m, K) sorted by group, `sizes` (G,) rows each, times their group's rhs (G, K, N).
    Rows past the groups are room nobody reads: ragged_dot gives zeros there, megablox (TPU;
    `interpret` runs it on a CPU) leaves them unwritten, forward and backward, and visits only
    the groups' rows, where XLA's ragged_dot may compute every row for every group; masking the
    room would pass over all of it, which is most of an expert-parallel step's memory traffic.
    `rows` (0: m): the rows a balanced routing fills; the kernel declares the cost of all m, and
    its name scope tells the plan (`planning.cost`) the share it really runs. `sizes` an int: every
    group that many rows, a batched matmul (where ragged_dot would compute every row per group)."""
    if isinstance(sizes, int) and kernel != "megablox":
        return jnp.einsum("gmk,gkn->gmn", lhs.reshape(len(rhs), sizes, -1), rhs).reshape(len(lhs), -1)
    if isinstance(sizes, int):
        sizes = jnp.full((len(rhs),), sizes, jnp.int32)
    if kernel != "megablox":  # ragged_dot, or auto where no platform resolved it
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    tiles = tuple(min(t, d) for t, d in zip(GMM_TILES, (lhs.shape[0], *rhs.shape[1:])))
    with jax.named_scope(f"{ROWS_SCOPE}{min(rows or len(lhs), len(lhs))}_of_{len(lhs)}"):
        return megablox.gmm(lhs, rhs, sizes, lhs.dtype, tiles, None, None, False, interpret)


# megablox's (rows, contraction, output) tile, as MaxText's defaults: each tile of rows is read
# once per output tile and each expert's weights once per tile of rows, so larger tiles move fewer
# bytes (128-wide ones made Mixtral's step memory-bound: 25.8 TB per chip).
GMM_TILES = (512, 1024, 1024)
ROWS_SCOPE = "expert_rows_"  # expert_rows_R_of_M: a grouped matmul given M rows runs about R
