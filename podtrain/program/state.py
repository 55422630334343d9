"""The model as pure functions of a params tree, and the sharded train state.

State is a plain dict {"step", "params", "opt"} (and "ema" with train.ema > 0) of arrays, each placed on the mesh by the
logical-axis rules when it is created (jit with out_shardings), so no device ever holds more
than its shard, even at initialisation. Under LoRA (train.lora.rank) "params" holds the adapters
alone and "base" the frozen weights, in the compute dtype; the checkpoints keep no "base".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from podtrain.config.schema import Config
from podtrain.models import build_model, lora
from podtrain.program import adapters, optim
from podtrain.sharding import logical_sharding, shardings_of


@dataclass
class ModelFns:
    """A model as data: how to build its params and how to apply them."""

    graphdef: Any
    abstract_params: Any  # tree of jax.ShapeDtypeStruct, with shardings
    logical_axes: Any  # tree of tuples of logical axis names
    make: Callable[[jax.Array], Any]  # key -> params, to be jitted (`initializer`)
    n_params: int
    mesh: Mesh  # where the params live and the model's activations are sharded

    def initializer(self, part=lambda params: params, shardings=None) -> Callable[[jax.Array], Any]:
        """key -> `part` of the initial params, jitted onto `shardings` (default: the params')."""
        # Init runs once; on CPU, XLA's optimisations of its random-number code cost more (~4x the
        # compile time) than they save.
        options = {"xla_backend_optimization_level": 0} if self.mesh.devices.flat[0].platform == "cpu" else None
        shardings = shardings_of(self.abstract_params) if shardings is None else shardings
        return jax.jit(lambda key: part(self.make(key)), out_shardings=shardings, compiler_options=options)

    @functools.cached_property
    def init(self) -> Callable[[jax.Array], Any]:
        """key -> params, sharded."""
        return self.initializer()

    def module(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    def apply(self, params, *inputs):
        return self.module(params)(*inputs)


def model_fns(cfg: Config, mesh: Mesh) -> ModelFns:
    def build(rngs):
        model, lora_cfg = build_model(cfg.model, rngs), cfg.train.lora
        if not lora_cfg.rank:
            return model
        names = adapters.weights_adapted(cfg)
        return lora.attach(model, names, lora_cfg.rank, lora_cfg.alpha, rngs, lora_cfg.dropout)

    def make(key):
        return nnx.to_pure_dict(nnx.state(build(nnx.Rngs(params=key))))

    abstract_model = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
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
    return ModelFns(graphdef, abstract, axes, make, n_params, mesh)


def decay_mask(logical_axes):
    """Weight decay on matrices only: leaves with two or more axes besides the layer stack and
    head_dim (an attention bias, (heads, head_dim), is a vector per head)."""
    return jax.tree.map(
        lambda names: sum(n not in ("layers", "head_dim") for n in names) >= 2,
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


@dataclass
class TrainSetup:
    fns: ModelFns
    tx: optax.GradientTransformation
    abstract_state: Any  # {"step", "params", "opt"} (and "base" under LoRA) as ShapeDtypeStructs with shardings
    init_trained: Callable[[jax.Array], Any]  # key -> the trained params (all, or LoRA's adapters), sharded

    @property
    def n_trained(self) -> int:
        """Parameters the optimizer trains: all, or LoRA's adapters."""
        return sum(s.size for s in jax.tree.leaves(self.abstract_state["params"]))

    @property
    def abstract_start(self):
        """What a run's starting weights (train.init_from) are read onto: LoRA's base, else all params."""
        return self.abstract_state.get("base", self.fns.abstract_params)


def train_setup(cfg: Config, mesh: Mesh) -> TrainSetup:
    fns = model_fns(cfg, mesh)
    trained, axes, init_trained, state = fns.abstract_params, fns.logical_axes, fns.init, {}
    if cfg.train.lora.rank:  # the optimizer sees the adapters alone; the base is an input of the step
        (trained, base), axes = lora.split(fns.abstract_params), lora.split(fns.logical_axes)[0]
        state["base"] = adapters.compute_dtype(base, cfg.model.compute_dtype)
        init_trained = fns.initializer(lambda params: lora.split(params)[0], shardings_of(trained))
    tx = optim.optimizer(cfg.train, decay_mask(axes))
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(tx.init, trained)
    opt_shardings = _like_their_params(opt_shapes, trained, replicated)
    abstract_opt = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, opt_shardings
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = {"step": step, "params": trained, "opt": abstract_opt, **state}
    if cfg.train.ema:
        state["ema"] = trained
    return TrainSetup(fns, tx, state, init_trained)


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


def init_state(setup: TrainSetup, seed: int, weights=None) -> dict:
    """Step 0: `weights` (on `setup.abstract_start`; random from `seed` if None) with a fresh
    optimizer; under LoRA `weights` are the base, and the adapters start from `seed`."""
    state = {}
    if "base" in setup.abstract_state:
        if weights is None:  # a random base: to run or time the step, not to fine-tune
            frozen = setup.abstract_state["base"]

            def base(params):
                return jax.tree.map(lambda x, s: x.astype(s.dtype), lora.split(params)[1], frozen)

            weights = setup.fns.initializer(base, shardings_of(frozen))(jax.random.key(seed))
        state["base"], params = weights, setup.init_trained(jax.random.key(seed))
    else:
        params = setup.init_trained(jax.random.key(seed)) if weights is None else weights
    opt = jax.jit(setup.tx.init, out_shardings=shardings_of(setup.abstract_state["opt"]))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), setup.abstract_state["step"].sharding)
    state = {"step": step, "params": params, "opt": opt, **state}
    if "ema" in setup.abstract_state:
        state["ema"] = jax.tree.map(jnp.copy, params)  # own buffers: the step donates both
    return state


def weights(state: dict):
    """The weights to evaluate and sample with: the EMA where the run keeps one (with LoRA's base)."""
    trained = state.get("ema", state["params"])
    return trained if "base" not in state else lora.union(state["base"], trained)
