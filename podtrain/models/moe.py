"""A mixture-of-experts decoder: the Llama-style decoder whose MLPs are routed experts
(`experts.py`), the first `first_dense_layers` dense. Mixtral, Qwen3-MoE and DeepSeek-V3's
routing are options of it; the balancing losses are reported through `auxiliary`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.config.keys import key, same_key
from podtrain.config.schema import ModelConfig
from podtrain.errors import ConfigError
from podtrain.models import llama
from podtrain.models.experts import RoutedExperts, Routing, balancing_loss
from podtrain.models.family import Family
from podtrain.models.layers import stacked


@dataclass
class MoeConfig(llama.LlamaConfig):
    name: str = same_key(ModelConfig, "name", "moe")
    experts: int = key(8, "routed experts per MoE layer", ">= 1")
    experts_per_token: int = key(2, "experts each token goes through (top-k)", ">= 1")
    expert_d_ff: int = key(0, "hidden width of each expert's MLP; 0: d_ff", ">= 0")
    shared_experts: int = key(0, "experts every token goes through, beside the routed ones, as one MLP", ">= 0")
    first_dense_layers: int = key(0, "layers (from the bottom) with a dense MLP of d_ff instead of experts", ">= 0")
    router: Literal["softmax", "sigmoid"] = key(
        "softmax",
        "softmax: over all experts, then the top k (Mixtral, Qwen3-MoE); sigmoid: a score per expert, chosen with a "
        "selection-only bias per expert (DeepSeek-V3's e_score_correction_bias) that router_bias_update_rate moves",
    )
    router_renormalize: bool = key(True, "the k chosen experts' weights divided by their sum (norm_topk_prob)")
    router_groups: int = key(1, "experts fall into this many equal groups (DeepSeek-V3's n_group)", ">= 1")
    router_topk_groups: int = key(
        1, "a token chooses among the groups whose two best scores sum highest, this many", ">= 1"
    )
    routed_scale: float = key(1.0, "the routed experts' weights times this (routed_scaling_factor)", "> 0")
    router_aux_loss_coef: float = key(
        0.01, "weight of the load-balancing loss (transformers' load_balancing_loss_func) in the training loss", ">= 0"
    )
    router_z_loss_coef: float = key(
        0.0, "weight of the router z-loss, the mean squared logsumexp of its logits", ">= 0"
    )
    router_bias_update_rate: float = key(
        0.0,
        "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the choice only, "
        "moved after each step by this toward balance (+rate for experts given fewer copies than the mean, -rate "
        "for more); 0: the bias stays as it is (a sigmoid router's; a softmax router then has none)",
        ">= 0",
    )
    capacity_factor: float = key(
        0.0,
        "each expert takes at most this x its even share of each sequence's token copies, the rest dropped (and "
        "counted); 0: none dropped",
        ">= 0",
    )
    expert_kernel: Literal["auto", "ragged_dot", "megablox"] = key(
        "auto",
        "the experts' grouped matmuls: ragged_dot (XLA's jax.lax.ragged_dot), megablox (the Pallas TPU kernel, "
        "which visits only the rows a device's experts were given); auto: megablox on TPU, else ragged_dot",
    )
    hf_type: str = same_key(llama.LlamaConfig, "hf_type", "mixtral")

    @property
    def expert_width(self) -> int:
        return self.expert_d_ff or self.d_ff

    def stack_lengths(self) -> tuple[int, ...]:
        dense = self.first_dense_layers
        return (dense, self.n_layers - dense) if dense else (self.n_layers,)

    def routing(self) -> Routing:
        return Routing(
            self.experts,
            self.experts_per_token,
            self.router,
            self.router_renormalize,
            self.router_groups,
            self.router_topk_groups,
            self.routed_scale,
        )

    def validate(self) -> None:
        super().validate()
        if self.experts_per_token > self.experts:
            raise ConfigError(
                f"model.experts_per_token={self.experts_per_token} is more than model.experts={self.experts}; "
                "a token goes through at most every expert."
            )
        if self.first_dense_layers >= self.n_layers:
            raise ConfigError(
                f"model.first_dense_layers={self.first_dense_layers} leaves none of model.n_layers={self.n_layers} "
                "to the experts; make it smaller, or use model.name=llama for a dense model."
            )
        g = self.router_groups
        if self.experts % g or (g > 1 and self.experts // g < 2) or self.router_topk_groups > g:
            raise ConfigError(
                f"model.router_groups={g} with model.experts={self.experts} and model.router_topk_groups="
                f"{self.router_topk_groups}: the groups must split the experts evenly, at least 2 to a group, and "
                "a token chooses among at most all of them."
            )
        if g > 1 and self.experts_per_token > self.router_topk_groups * self.experts // g:
            raise ConfigError(
                f"model.experts_per_token={self.experts_per_token} is more than the {self.router_topk_groups} "
                f"groups of {self.experts // g} experts a token chooses among; raise model.router_topk_groups."
            )


class MoeBlock(llama.Block):
    """A decoder block whose MLP is routed experts; it returns (x, the router's statistics)."""

    reports = True

    def make_mlp(self, cfg: MoeConfig, std: float, out_std: float, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return RoutedExperts(
            cfg.d_model,
            cfg.expert_width,
            cfg.routing(),
            std=std,
            out_std=out_std,
            dtype=dtype,
            rngs=rngs,
            capacity_factor=cfg.capacity_factor,
            shared=cfg.shared_experts,
            kernel=cfg.expert_kernel,
            bias=cfg.router_bias_update_rate > 0 or cfg.router == "sigmoid",
        )

    def __call__(self, x: jax.Array, rope, segments, positions, window=None) -> tuple[jax.Array, dict]:
        found = []

        def routed(h):
            out, statistics = self.mlp(h)
            found.append(statistics)
            return out

        return super().__call__(x, rope, segments, positions, window, mlp=routed), found[0]

    def decode(self, x: jax.Array, rope, start, valid, cache, window=None) -> tuple[jax.Array, tuple]:
        return super().decode(x, rope, start, valid, cache, window, mlp=lambda h: self.mlp(h)[0])


class Moe(llama.Llama):
    """A LanguageModel like Llama whose layers above `first_dense_layers` route each token to
    `experts_per_token` of `experts` MLPs; `features`' auxiliary terms are the balancing losses
    and the experts' load."""

    block = MoeBlock

    def build_layers(self, cfg: MoeConfig, rngs: nnx.Rngs) -> None:
        if cfg.first_dense_layers:
            self.dense_layers = stacked(cfg.first_dense_layers, lambda r: llama.Block(cfg, r), rngs)
        self.layers = stacked(cfg.n_layers - cfg.first_dense_layers, lambda r: self.block(cfg, r), rngs)

    def stacks(self) -> list[tuple[nnx.Module, int]]:
        moe = [(self.layers, self.cfg.n_layers - self.cfg.first_dense_layers)]
        return [(self.dense_layers, self.cfg.first_dense_layers), *moe] if self.cfg.first_dense_layers else moe

    def auxiliary(self, reports: list) -> dict:
        """The load-balancing loss (`balancing_loss`) and the z-loss, both pooled over every MoE
        layer's tokens; "expert_load", the largest over layers of the busiest expert's copies over
        the mean (1 when balanced), each layer's too; "dropped", the share of copies dropped for
        capacity."""
        cfg, r = self.cfg, reports[-1]
        balance, z = balancing_loss(r["load"], r["score"]), r["z"].mean()
        load = r["load"].max(-1) / r["load"].mean(-1)
        aux = {
            "loss": cfg.router_aux_loss_coef * balance + cfg.router_z_loss_coef * z,
            "aux_loss": balance,
            "z_loss": z,
            "expert_load": load.max(),
            **{f"expert_load/{cfg.first_dense_layers + i}": load[i] for i in range(len(load))},
        }
        aux |= {"dropped": r["dropped"].mean()} if cfg.capacity_factor else {}
        return aux | ({EXPERT_LOADS: r["load"]} if cfg.router_bias_update_rate else {})


EXPERT_LOADS = "expert_loads"  # each MoE layer's share of copies per expert (layers, E), for the bias update


def update_router_bias(cfg: MoeConfig, params, metrics: dict):
    """DeepSeek-V3's auxiliary-loss-free balancing, after each optimizer step: each expert's
    selection bias moves by router_bias_update_rate toward balance, up where the step gave it
    fewer token copies than the mean, down where more (the loads of all microbatches pooled)."""
    if not cfg.router_bias_update_rate:
        return params, metrics
    metrics = dict(metrics)
    load = metrics.pop(EXPERT_LOADS)
    mlp = params["layers"]["mlp"]
    bias = mlp["router_bias"] + cfg.router_bias_update_rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    return {**params, "layers": {**params["layers"], "mlp": {**mlp, "router_bias": bias}}}, metrics


def flops_per_token(cfg: MoeConfig, n_params: int, seq_len: int, per_weight: int = 6) -> float:
    """Llama's count of the parameters a token uses: of each MoE layer's experts, its k."""
    idle = (cfg.experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.expert_width
    return llama.flops_per_token(cfg, n_params - (cfg.n_layers - cfg.first_dense_layers) * idle, seq_len, per_weight)


DEBUG = {**llama.DEBUG, "expert_d_ff": 96}

FAMILY = Family(MoeConfig, Moe, flops_per_token, "language", DEBUG, update_router_bias)
