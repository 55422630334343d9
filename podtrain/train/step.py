"""The jitted train and eval steps. Gradients are reduced across the mesh by XLA's partitioner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.runtime.mesh import RULES
from podtrain.train import optim
from podtrain.train.state import TrainSetup, shardings_of


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def batch_sharding(mesh: Mesh, leading: int = 0) -> NamedSharding:
    """Rows of a batch over (data, fsdp); `leading` unsharded axes come first (microbatches)."""
    return NamedSharding(mesh, PartitionSpec(*(None,) * leading, RULES["batch"]))


def make_train_step(setup: TrainSetup, cfg_train, mesh: Mesh):
    """step(state, batch) -> (state, metrics); batch is (grad_accum, microbatch, seq_len + 1).

    Microbatch gradients are summed in a scan inside the step, so accumulation costs no
    extra dispatch and the accumulator lives sharded like the params.
    """
    fns, tx, lr = setup.fns, setup.tx, optim.schedule(cfg_train)
    param_shardings = shardings_of(setup.abstract_state["params"])

    def loss_fn(params, tokens):
        return cross_entropy(fns.apply(params, tokens[:, :-1]), tokens[:, 1:])

    def step(state, batch):
        params = state["params"]

        def accumulate(acc, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_shardings)
        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), batch)
        loss, grads = jax.tree.map(lambda x: x / batch.shape[0], (loss, grads))
        updates, opt = tx.update(grads, state["opt"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates), "opt": opt}
        if "ema" in state:
            new_state["ema"] = optax.incremental_update(new_state["params"], state["ema"], step_size=1 - cfg_train.ema)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr(state["step"])}

    state_shardings = shardings_of(setup.abstract_state)
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding(mesh, leading=1)), out_shardings=(state_shardings, None), donate_argnums=0)


def make_eval_step(setup: TrainSetup, mesh: Mesh):
    """eval(params, batch) -> mean next-token loss of a (batch, seq_len + 1) batch."""
    fns = setup.fns

    def evaluate(params, tokens):
        return cross_entropy(fns.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return jax.jit(evaluate, in_shardings=(shardings_of(setup.abstract_state["params"]), batch_sharding(mesh)))
