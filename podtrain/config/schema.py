"""The config schema: every key with its type, default, valid values and a one-line description.

Plain dataclasses of `keys.key` fields (the parallelism sections in `parallel`), importing nothing
of podtrain but those, the axes table and errors: no jax. A key with a fixed set of values is a
`Literal`, a numeric key carries its `Range`; OmegaConf checks both when a config loads
(`podtrain.program.load`), and docs/configuration.md is generated from the same fields. A key that
names an entry of a registry above the config (an optimizer, an attention core, ...) is a `str`,
checked against that registry by `podtrain.program.checks.switches`, which the docs read too. Each model
family's config subclasses `ModelConfig` beside its model; each task's train keys subclass
`TrainConfig` beside the task.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Literal

from podtrain.config.keys import key
from podtrain.config.parallel import ContextConfig, MeshConfig, PipelineConfig
from podtrain.errors import ConfigError


@dataclass
class ModelConfig:
    """The keys every model family has. Each family's config, beside its model and registered in
    podtrain.models, adds its own; `model.name` picks which one a config is checked against."""

    name: str = key("llama", "the model family, one of those registered in podtrain.models")
    vocab_size: int = key(256, "tokens in the vocabulary (auto: the data's tokenizer's, rounded up to 128)", ">= 1")
    d_model: int = key(128, "width of the residual stream", ">= 1")
    n_heads: int = key(4, "attention heads (query heads with grouped-query attention)", ">= 1")
    d_ff: int = key(384, "hidden width of the MLP", ">= 1")
    max_seq_len: int = key(256, "positions the model can attend over", ">= 1")
    norm_eps: float = key(1e-5, "epsilon of the normalisation layers", "> 0")
    remat: str = key(
        "none",
        "what the backward recomputes: none, nothing; dots, all but the matmul outputs; full, each layer in full (bar "
        "what the model marks as kept: mHC's branch inputs and outputs, its mixing projection)",
    )
    scan_unroll: int | str = key(
        "auto",
        "layers per scan iteration; the layer count unrolls fully (auto: fully on a GPU where that step, compiled, "
        "takes at most 90% of a device's memory, else 1)",
        "auto or >= 1",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = key(
        "auto", "matmul and activation dtype (auto: bfloat16 on GPU/TPU, float32 on CPU); params stay float32"
    )
    attention: str = key(
        "auto", "attention core (the table below; auto: cudnn on GPU with bf16, splash on TPU, xla otherwise)"
    )
    matmul_precision: str = key(
        "compute", "the layers' weight matmuls: in the compute dtype, fp8 (H100/H200) or int8 (TPU v5e/v5p/v6e)"
    )

    def validate(self) -> None:
        """Relations between this family's keys; subclasses add theirs."""
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "pick sizes whose ratio is the head dimension."
            )


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA): the base weights frozen in the compute dtype, only A and B of each target
    trained, kept in the optimizer and the checkpoints; the base is train.init_from's."""

    rank: int = key(0, "rank of the adapters; 0: no adapters, every weight trained", ">= 0")
    alpha: float = key(16.0, "the adapters' output is scaled by alpha / rank", "> 0")
    dropout: float = key(0.0, "dropout on the adapters' input in training (PEFT's lora_dropout)", "[0, 1)")
    targets: list[str] = key(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "the projections adapted, by their Hugging Face names (attention's and dense MLPs'; no MoE expert)",
    )


@dataclass
class TrainConfig:
    """The keys of every task; a task adds its own (e.g. the text task's window length)."""

    steps: int = key(200, "optimizer steps of the run", ">= 1")
    batch_size: int = key(16, "global batch: examples per step across all devices and processes", ">= 1")
    lr: float = key(2e-3, "peak learning rate (linear warmup, then cosine decay)", "> 0")
    min_lr_ratio: float = key(0.1, "final learning rate as a fraction of the peak", "[0, 1]")
    warmup_steps: int = key(20, "steps of linear warmup", ">= 0")
    optimizer: str = key(
        "adamw", "adamw, or adam_atan2: Adam with atan2 in place of the division by sqrt(v) + eps (HRM, TRM)"
    )
    weight_decay: float = key(0.1, "decoupled weight decay, on matrices only", ">= 0")
    beta1: float = key(0.9, "Adam's first-moment decay", "[0, 1)")
    beta2: float = key(0.95, "Adam's second-moment decay", "[0, 1)")
    puzzle_emb_lr: float = key(
        0.0,
        "HRM/TRM: peak rate of sign-SGD on the puzzle embedding, as the references train it; 0: the optimizer's",
        ">= 0",
    )
    puzzle_emb_weight_decay: float = key(
        0.1, "HRM/TRM: sign-SGD's decoupled weight decay of the puzzle embedding", ">= 0"
    )
    grad_clip: float = key(1.0, "global gradient-norm clip (0: off)", ">= 0")
    grad_accum: int = key(
        1,
        "microbatches per step, their gradients summed inside the step; more where the devices need it",
        ">= 1",
    )
    device_batch: int = key(
        0,
        "most sequences a device takes per microbatch, the accumulation following the devices (on fewer, "
        "more microbatches; the global batch unchanged); 0: no limit",
        ">= 0",
    )
    init_from: str = key(
        "", "start from these weights (a podtrain run_dir, or a Hugging Face Llama folder or hub name)"
    )
    lora: LoraConfig = field(default_factory=LoraConfig)
    ema: float = key(0.0, "decay of an exponential moving average of the weights (e.g. 0.999); 0: none", "[0, 1)")
    log_every: int = key(20, "steps between metric lines", ">= 1")
    eval_every: int = key(100, "steps between evaluations (0: only after the last step)", ">= 0")
    eval_batches: int = key(8, "batches per evaluation", ">= 1")
    max_bad_steps: int = key(3, "non-finite steps in a row (each skipped) before training stops", ">= 1")
    profile_steps: list[int] = key(
        [], "[START, END]: trace steps START to END (inclusive) with jax.profiler into RUN_DIR/profile; []: none"
    )


@dataclass
class CheckpointConfig:
    every: int = key(100, "steps between checkpoints (0: only after the last step)", ">= 0")
    keep: int = key(3, "newest checkpoints kept", ">= 1")
    dir: str | None = key(None, "where checkpoints go (default: RUN_DIR/checkpoints); a local path or gs://BUCKET/...")
    async_save: bool = key(True, "write checkpoints in the background while training goes on")
    replica_every: int = key(
        0,
        "steps between copies of the state in host memory, which the processes left write out when one is lost "
        "so that the restart resumes from that step (several processes only; 0: none)",
        ">= 0",
    )


@dataclass
class DataConfig:
    source: str = key("pydoc", "where the data comes from: a source of podtrain.data.registry (the table below)")
    path: str | None = key(None, "the corpus, shards or puzzles of data.source")
    tokenizer: str = key(
        "auto", "auto (the shards' own for tokens, else bytes), bytes, a folder with tokenizer.json, or a hub model"
    )
    format: str = key(
        "text", "what the rows hold and how they are made: a format of the language task (the table below)"
    )
    pack: Literal["concat", "documents"] = key(
        "concat", "concat: documents joined by EOS into rows; documents: attention stays inside each document"
    )
    reset_positions: bool = key(
        False,
        "positions restart at 0 with each packed document (data.pack=documents, or chat) instead of running on; "
        "rotary embeddings see only distances, so this changes rounding at large positions, not the model",
    )
    val_fraction: float = key(0.1, "held-out share of in-memory text (prepared shards have their own)", "(0, 1)")
    dataset_name: str | None = key(None, "if set, the config of the hub dataset the shards must come from")
    workers: int = key(0, "loader processes (grain); 0: threads of this process", ">= 0")
    prefetch: int = key(2, "batches read ahead of the step", ">= 0")


@dataclass
class LogConfig:
    to: list[str] = key(
        ["jsonl", "tensorboard"],
        "where metrics go, by process 0: RUN_DIR/metrics.jsonl, TensorBoard events in RUN_DIR, Weights & Biases",
    )
    wandb_project: str = key("podtrain", "the W&B project of the run")
    wandb_name: str = key("", "the W&B run's name (empty: the run directory's name)")
    wandb_tags: list[str] = key([], "tags of the W&B run")


@dataclass
class EvalConfig:
    tasks: list[str] = key(
        [],
        "lm-evaluation-harness tasks scored during training on the training mesh, e.g. [hellaswag, arc_easy] "
        "(the eval extra); their scores are metrics eval/TASK/METRIC",
    )
    every: int = key(0, "steps between task evaluations (0: only after the last step)", ">= 0")
    limit: int = key(0, "examples per task (0: every one)", ">= 0")
    num_fewshot: int | None = key(None, "examples in each prompt (None: each task's own)")
    batch_size: int = key(8, "requests scored or generated together", ">= 1")
    include_path: str = key("", "a folder of lm-eval task YAMLs beside its own (local tasks, offline data)")


@dataclass
class DistributedConfig:
    init_timeout: int = key(300, "seconds for all processes to join the coordinator", ">= 1")
    heartbeat_timeout: int = key(
        10, "seconds without a heartbeat after which a process is lost and the others stop to be restarted", ">= 2"
    )
    shutdown_timeout: int = key(120, "seconds a finished process waits for the others to finish too", ">= 1")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the family's config, by model.name
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # the task's, by the family's task
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    device_type: Literal["auto", "tpu", "gpu", "cuda", "cpu"] = key(
        "auto", "the devices to run on (auto: TPU, then GPU, then CPU); a forced one that is absent is an error"
    )
    compile_cache: str = key(
        "auto",
        "where compiled programs are kept for later runs: auto ($XDG_CACHE_HOME or ~/.cache), a folder (gs:// too), "
        "or off",
    )
    run_dir: str = key("runs/default", "the run's folder: config.yaml, metrics, events, checkpoints")
    seed: int = key(0, "seed of the initial weights and the data order", ">= 0")

    @property
    def checkpoint_dir(self) -> str:
        """A string, not a Path: Path would turn gs://bucket/run into the local gs:/bucket/run."""
        return self.checkpoint.dir or posixpath.join(self.run_dir, "checkpoints")
