"""The model as pure functions of a params tree, and the sharded train state.

State is a plain dict {"step", "params", "opt"} (and "ema" with train.ema > 0) of arrays, each placed on the mesh by the
logical-axis rules when it is created (jit with out_shardings), so no device ever holds more
than its shard, even at initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.config.schema import Config
from podtrain.models import build_model
from podtrain.sharding import logical_sharding, shardings_of
from podtrain.train import optim


@dataclass
class ModelFns:
    """A model as data: how to build its params and how to apply them."""

    graphdef: Any
    abstract_params: Any  # tree of jax.ShapeDtypeStruct, with shardings
    logical_axes: Any  # tree of tuples of logical axis names
    init: Callable[[jax.Array], Any]  # key -> params, sharded
    n_params: int
    mesh: Mesh  # where the params live and the model's activations are sharded

    def module(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    def apply(self, params, *inputs):
        return self.module(params)(*inputs)


def model_fns(cfg: Config, mesh: Mesh) -> ModelFns:
    def make(key):
        return nnx.to_pure_dict(nnx.state(build_model(cfg.model, nnx.Rngs(params=key))))

    abstract_model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    axes = jax.tree.map(
        tuple, nnx.to_pure_dict(nnx.get_partition_spec(abstract_state)), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    shapes = jax.eval_shape(make, jax.random.key(0))
    shardings = jax.tree.map(
        lambda names, s: logical_sharding(names, s.shape, mesh), axes, shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    n_params = sum(s.size for s in jax.tree.leaves(shapes))
    # Init runs once; on CPU, XLA's optimisations of its random-number code cost more (~4x the
    # compile time) than they save.
    options = {"xla_backend_optimization_level": 0} if mesh.devices.flat[0].platform == "cpu" else None
    return ModelFns(
        graphdef, abstract, axes, jax.jit(make, out_shardings=shardings, compiler_options=options), n_params, mesh
    )


def decay_mask(fns: ModelFns):
    """Weight decay on matrices only: leaves with two or more axes besides the layer stack and
    head_dim (an attention bias, (heads, head_dim), is a vector per head)."""
    return jax.tree.map(
        lambda names: sum(n not in ("layers", "head_dim") for n in names) >= 2,
        fns.logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


@dataclass
class TrainSetup:
    fns: ModelFns
    tx: optax.GradientTransformation
    abstract_state: Any  # {"step", "params", "opt"} as ShapeDtypeStructs with shardings


def train_setup(cfg: Config, mesh: Mesh) -> TrainSetup:
    fns = model_fns(cfg, mesh)
    tx = optim.optimizer(cfg.train, decay_mask(fns))
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(tx.init, fns.abstract_params)
    opt_shardings = _like_their_params(opt_shapes, fns.abstract_params, replicated)
    abstract_opt = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_shardings
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = {"step": step, "params": fns.abstract_params, "opt": abstract_opt}
    if cfg.train.ema:
        state["ema"] = fns.abstract_params
    return TrainSetup(fns, tx, state)


def _like_their_params(opt_shapes, abstract_params, replicated):
    """Optimizer moments follow their parameter's sharding, found by the path under which the state
    keeps them (also inside optax's partitions, which hold part of the tree); counters are replicated."""
    params = {tuple(k.key for k in path): p for path, p in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

    def sharding(path, leaf):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        for start in range(len(keys)):
            param = params.get(keys[start:])
            if param is not None and param.shape == leaf.shape:
                return param.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(sharding, opt_shapes)


def init_state(setup: TrainSetup, seed: int, params=None) -> dict:
    """Step 0: `params` (random from `seed` if None) with a fresh optimizer."""
    params = setup.fns.init(jax.random.key(seed)) if params is None else params
    opt = jax.jit(setup.tx.init, out_shardings=shardings_of(setup.abstract_state["opt"]))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), setup.abstract_state["step"].sharding)
    state = {"step": step, "params": params, "opt": opt}
    if "ema" in setup.abstract_state:
        state["ema"] = jax.tree.map(jnp.copy, params)  # own buffers: the step donates both
    return state


def weights(state: dict):
    """The weights to evaluate and sample with: the EMA where the run keeps one."""
    return state.get("ema", state["params"])
