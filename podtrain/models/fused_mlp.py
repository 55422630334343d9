"""SwiGLU's MLP as one Pallas kernel for TPU: swiglu(x w_in) w_down with the (rows, 2, d_ff)
pre-activations and the hidden layer kept in VMEM, forward and backward, never written to HBM.

The recursive models' step is memory-bound on XLA's MLP: XLA writes the pre-activations (six
times the size of x at d_ff = 3 d) and the hidden layer to HBM and reads them back, in the forward
and again in the backward, which computes them anew (`layers.swiglu_mlp`). Here a block of rows
goes through both matmuls in VMEM; the backward recomputes the block's pre-activations and
accumulates the weight gradients in float32 in VMEM over the row blocks, so HBM sees x, the
output's gradient, the weights, dx and the weight gradients once. Matmuls take the inputs' dtype
and accumulate in float32, as XLA's do; the elementwise SwiGLU and its derivative run in float32.

Each device runs the kernel on its own rows (`sharding.per_shard`); it needs the contracted axis
and the hidden axis whole (no tensor parallelism over them), which `fits` tells.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from podtrain.sharding import per_shard, shards

ROWS = 256  # rows of x per kernel step: a multiple of the TPU's 8 sublanes
HIDDEN = 512  # hidden units per step of the weight-gradient kernel: its float32 gradients fit VMEM
VMEM_LIMIT = 15 * 2**20  # within the smallest VMEM of the targets (16 MiB on v4)


def fits(x_axes: tuple[str, ...], d_in: int, d_ff: int) -> bool:
    """Whether each device holds whole rows of x and whole weights under the current mesh."""
    return shards(x_axes[-1], d_in) == 1 and shards("act_mlp", d_ff) == 1


def _dot(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _pre_activations(x, wg, wu):
    """gate, up and sigmoid(gate) of a block, in float32."""
    gate, up = _dot(x, wg), _dot(x, wu)
    return gate, up, jax.nn.sigmoid(gate)


def _hidden_gradients(d_out, wd, gate, up, sig, dtype):
    """The gradients of gate and up, from the output's through w_down and SwiGLU's derivative."""
    d_hidden = _dot(d_out, wd, ((1,), (1,)))
    return (d_hidden * up * sig * (1 + gate * (1 - sig))).astype(dtype), (d_hidden * gate * sig).astype(dtype)


def _forward_kernel(x_ref, wg_ref, wu_ref, wd_ref, out_ref):
    x = x_ref[...]
    gate, up, sig = _pre_activations(x, wg_ref[...], wu_ref[...])
    out_ref[...] = _dot((gate * sig * up).astype(x.dtype), wd_ref[...]).astype(out_ref.dtype)


def _dx_kernel(x_ref, d_out_ref, wg_ref, wu_ref, wd_ref, dx_ref):
    x, wg, wu = x_ref[...], wg_ref[...], wu_ref[...]
    d_gate, d_up = _hidden_gradients(d_out_ref[...], wd_ref[...], *_pre_activations(x, wg, wu), x.dtype)
    dx_ref[...] = (_dot(d_gate, wg, ((1,), (1,))) + _dot(d_up, wu, ((1,), (1,)))).astype(dx_ref.dtype)


def _dw_kernel(x_ref, d_out_ref, wg_ref, wu_ref, wd_ref, dwg_ref, dwu_ref, dwd_ref):
    """One block of hidden units (grid axis 0) over all row blocks (axis 1), summed in place."""
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(1) == 0)
    def _():
        for ref in (dwg_ref, dwu_ref, dwd_ref):
            ref[...] = jnp.zeros_like(ref)

    x, d_out = x_ref[...], d_out_ref[...]
    gate, up, sig = _pre_activations(x, wg_ref[...], wu_ref[...])
    d_gate, d_up = _hidden_gradients(d_out, wd_ref[...], gate, up, sig, x.dtype)
    rows = ((0,), (0,))
    dwd_ref[...] += _dot((gate * sig * up).astype(x.dtype), d_out, rows)
    dwg_ref[...] += _dot(x, d_gate, rows)
    dwu_ref[...] += _dot(x, d_up, rows)


def _call(kernel, grid, in_specs, outs, semantics, flops: int, interpret: bool, row_reads: int = 1):
    """The kernel over `grid`, declaring its FLOPs and HBM bytes to the compiler (and the plan): its
    inputs, the first two (the rows) read `row_reads` times, and its outputs, once."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def run(*arrays):
        sizes = [a.size * a.dtype.itemsize for a in arrays]
        moved = (
            sum(sizes)
            + (row_reads - 1) * sum(sizes[:2])
            + sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype, _ in outs)
        )
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=[spec for _, _, spec in outs],
            out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in outs],
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT),
            cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=moved),
            interpret=interpret,
        )(*arrays)

    return run


def _by_rows(d: int):
    from jax.experimental import pallas as pl

    return pl.BlockSpec((ROWS, d), lambda i, *_: (i, 0))


def _whole(shape):
    from jax.experimental import pallas as pl

    return pl.BlockSpec(shape, lambda *_: (0, 0))


def _rows(x: jax.Array) -> tuple[jax.Array, int]:
    """x as (rows, d) padded with zero rows to whole blocks (they add nothing to any gradient)."""
    flat = x.reshape(-1, x.shape[-1])
    padded = -(-len(flat) // ROWS) * ROWS
    return jnp.pad(flat, ((0, padded - len(flat)), (0, 0))), len(flat)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mlp(x, w_in, w_down, interpret):
    return _mlp_fwd(x, w_in, w_down, interpret)[0]


def _mlp_fwd(x, w_in, w_down, interpret):
    rows, n = _rows(x)
    (m, d), f = rows.shape, w_down.shape[0]
    (out,) = _call(
        _forward_kernel,
        (m // ROWS,),
        [_by_rows(d), _whole((d, f)), _whole((d, f)), _whole((f, d))],
        [((m, d), x.dtype, _by_rows(d))],
        ("parallel",),
        6 * m * d * f,
        interpret,
    )(rows, w_in[:, 0], w_in[:, 1], w_down)
    return out[:n].reshape(x.shape), (x, w_in, w_down)


def _mlp_bwd(interpret, residuals, d_out):
    from jax.experimental import pallas as pl

    x, w_in, w_down = residuals
    (rows, n), (d_rows, _) = _rows(x), _rows(d_out.astype(x.dtype))
    (m, d), f = rows.shape, w_down.shape[0]
    weights = (rows, d_rows, w_in[:, 0], w_in[:, 1], w_down)
    (dx,) = _call(
        _dx_kernel,
        (m // ROWS,),
        [_by_rows(d), _by_rows(d), _whole((d, f)), _whole((d, f)), _whole((f, d))],
        [((m, d), x.dtype, _by_rows(d))],
        ("parallel",),
        10 * m * d * f,
        interpret,
    )(*weights)
    block = min(HIDDEN, f)
    columns = pl.BlockSpec((d, block), lambda j, i: (0, j))
    hidden_rows = pl.BlockSpec((block, d), lambda j, i: (j, 0))
    rows_spec = pl.BlockSpec((ROWS, d), lambda j, i: (i, 0))
    dwg, dwu, dwd = _call(
        _dw_kernel,
        (-(-f // block), m // ROWS),
        [rows_spec, rows_spec, columns, columns, hidden_rows],
        [((d, f), jnp.float32, columns), ((d, f), jnp.float32, columns), ((f, d), jnp.float32, hidden_rows)],
        ("parallel", "arbitrary"),
        12 * m * d * f,
        interpret,
        row_reads=-(-f // block),
    )(*weights)
    return dx[:n].reshape(x.shape), jnp.stack([dwg, dwu], axis=1).astype(w_in.dtype), dwd.astype(w_down.dtype)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fused_swiglu_mlp(
    x: jax.Array, w_in: jax.Array, w_down: jax.Array, x_axes: tuple[str, ...], interpret: bool = False
) -> jax.Array:
    """swiglu(x w_in) w_down for w_in (d, 2, d_ff) gate first, on each device's rows of x;
    `interpret` runs the kernel on any backend (tests)."""
    weights = (None,) * 3
    run = per_shard(lambda x, w_in, w_down: _mlp(x, w_in, w_down, interpret), (x_axes, weights, weights[:2]), x_axes)
    return run(x, w_in, w_down)
