"""The jitted train step, shared by every model. Gradients are reduced across the mesh by XLA's partitioner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from podtrain.models import lora
from podtrain.program import optim
from podtrain.program.state import TrainSetup
from podtrain.sharding import DEFAULT, Parallelism, batch_sharding, sharded_jit, shardings_of


def make_train_step(
    setup: TrainSetup,
    cfg_train,
    mesh: Mesh,
    loss_fn,
    abstract_state: dict,
    seed: int = 0,
    after_step=None,
    parallelism: Parallelism = DEFAULT,
):
    """step(state, batch) -> (state, metrics); batch is (grad_accum, microbatch, ...).

    loss_fn(model, carry, microbatch, key) -> (loss, (carry, metrics)) is a task's loss
    (program/tasks) of the model built from the params (with LoRA's base); `carry` is this
    microbatch's slice of state["carry"] (HRM/TRM's ACT state; None without one), `key` fresh
    randomness for every microbatch of every step. A step whose loss or gradient norm is not finite
    leaves the state unchanged but for the step (metric `skipped`). Microbatch gradients are summed
    in a scan inside the step, the accumulator sharded like the params. A metric is a scalar,
    averaged over the microbatches, or a (sum, count) pair, pooled. `after_step(params, metrics)
    -> (params, metrics)` (an MoE's router bias update) runs on the updated params and takes out
    the metrics it reads.
    """
    tx, lr, fns = setup.tx, optim.schedule(cfg_train), setup.fns
    param_shardings = shardings_of(setup.abstract_state["params"])  # of the accumulated gradients too

    def params_loss(params, base, carry, micro, key):
        model = fns.module(params if base is None else lora.union(base, params))
        with lora.dropout_key(jax.random.fold_in(key, 1) if cfg_train.lora.dropout else None):
            return loss_fn(model, carry, micro, key)

    def train_step(state, batch):
        params, base, n_micro = state["params"], state.get("base"), batch.shape[0]
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), state["step"]), n_micro)

        def accumulate(grads, xs):
            carry, micro, key = xs
            (loss, (carry, metrics)), g = jax.value_and_grad(params_loss, has_aux=True)(params, base, carry, micro, key)
            return jax.tree.map(jnp.add, grads, g), (carry, {"loss": loss, **metrics})

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_shardings)
        grads, (carry, metrics) = jax.lax.scan(accumulate, zeros, (state.get("carry"), batch, keys))
        grads = jax.tree.map(lambda g: g / n_micro, grads)
        updates, opt = tx.update(grads, state["opt"], params)
        updated = {"params": optax.apply_updates(params, updates), "opt": opt}  # LoRA's base stays as it was
        updated |= {} if carry is None else {"carry": carry}
        if "ema" in state:
            updated["ema"] = optax.incremental_update(updated["params"], state["ema"], step_size=1 - cfg_train.ema)
        metrics, grad_norm = {k: _pool(v) for k, v in metrics.items()}, optax.tree.norm(grads)
        if after_step is not None:
            updated["params"], metrics = after_step(updated["params"], metrics)
        # A non-finite loss or gradient skips the update: the state stays as it was, only the step
        # (the data position) moves on, so no NaN ever reaches the weights or a checkpoint.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        kept = {k: jax.tree.map(lambda new, old: jnp.where(finite, new, old), v, state[k]) for k, v in updated.items()}
        metrics |= {"grad_norm": grad_norm, "lr": lr(state["step"]), "skipped": ~finite}
        return {**state, **kept, "step": state["step"] + 1}, metrics

    shardings, batches = shardings_of(abstract_state), batch_sharding(mesh, leading=1)
    jit = {"in_shardings": (shardings, batches), "out_shardings": (shardings, None), "donate_argnums": 0}
    return sharded_jit(train_step, mesh, parallelism, **jit)


def _pool(metric) -> jax.Array:
    """The mean over microbatches, or for (sums, counts) their ratio: NaN (logged as null) where nothing was counted."""
    if isinstance(metric, tuple):
        total, count = metric[0].sum(), metric[1].sum()
        return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)
    return metric.mean(0)


def mean_over_batches(eval_step, params, batches) -> dict:
    """The mean over a reader's batches of eval_step(params, batch), a dict of means over the
    global batch (reduced across all processes inside the step), or of (sum, count) pairs, pooled
    (so that padding rows, counted in no batch's count, weigh nothing)."""
    results = [jax.device_get(eval_step(params, batches[i])) for i in range(len(batches))]
    return {k: _pooled_over([res[k] for res in results]) for k in results[0]}


def _pooled_over(values: list) -> float:
    if isinstance(values[0], tuple):
        count = sum(float(c) for _, c in values)
        return sum(float(s) for s, _ in values) / count if count else float("nan")
    return float(np.mean(values))
