"""A run directory, and a run opened on this machine.

RUN_DIR holds everything of one training run: config.yaml (the config it trains with),
tokenizer/ (a copy of a text run's tokenizer, for generate and export), checkpoints/ (unless
checkpoint.dir puts them elsewhere), metrics.jsonl, TensorBoard events and logs/. `train`,
`generate`, `convert`, `checkpoints`, `plot` and `eval` all reach a run through `Run`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from podtrain import runtime, storage
from podtrain.config.parallel import MeshConfig
from podtrain.config.schema import Config
from podtrain.data.tokenizer import BYTES, keep_tokenizer, load_tokenizer
from podtrain.errors import CheckpointError, ConfigError, DataError, MeshError
from podtrain.interop.hf import checkpoint as hf_checkpoint
from podtrain.interop.hf import config_json, families
from podtrain.models import lora
from podtrain.program.prepare import final
from podtrain.program.saved import config_file, differences, run_config, save_config
from podtrain.program.state import ModelFns, model_fns
from podtrain.program.tasks.registry import require_language
from podtrain.train import lease
from podtrain.train.checkpoint import Checkpointer, CheckpointMismatch


@dataclass
class Run:
    dir: Path
    cfg: Config

    TOKENIZER = "tokenizer"

    @classmethod
    def of(cls, cfg: Config) -> Run:
        """The run a config trains into (it may not exist yet)."""
        return cls(storage.path(cfg.run_dir), cfg)

    @classmethod
    def at(cls, run_dir: str | Path) -> Run:
        """An existing run, with the config it was trained with."""
        return cls(storage.path(run_dir), run_config(run_dir))

    @property
    def exists(self) -> bool:
        return config_file(self.dir).is_file()

    @property
    def checkpoint_dir(self) -> str:
        """RUN_DIR/checkpoints, wherever the run has been moved or copied to, or the
        `checkpoint.dir` it was told to write elsewhere (a string: gs:// paths stay as they are)."""
        inside = self.dir / "checkpoints"
        return str(inside) if inside.is_dir() or not self.cfg.checkpoint.dir else self.cfg.checkpoint.dir

    def checkpointer(self) -> Checkpointer:
        c = self.cfg.checkpoint
        return Checkpointer(self.checkpoint_dir, c.keep, c.async_save)

    def tokenizer(self):
        """The tokenizer the run trained with: its kept copy, or bytes."""
        kept = self.dir / self.TOKENIZER
        return load_tokenizer(str(kept) if kept.is_dir() else BYTES)

    def check_tokenizer(self, tokenizer) -> None:
        """A resumed run must keep the tokenizer its embeddings were trained on."""
        if self.exists and (before := self.tokenizer().identity) != tokenizer.identity:
            raise DataError(
                f"{self.dir} was trained with another tokenizer (sha256 {before[:12]}) than this data's "
                f"({tokenizer.spec}, {tokenizer.identity[:12]}); its embeddings would read the wrong tokens. "
                "Use data prepared with the run's tokenizer, or a new run_dir."
            )

    def lock(self):
        """Held while a job writes the run; a second job on the directory is refused (podtrain.train.lease)."""
        return lease.hold(self.dir)

    def keep(self, cfg: Config, tokenizer=None) -> None:
        """Write config.yaml and a copy of the tokenizer (process 0 only)."""
        storage.makedirs(self.dir)
        save_config(cfg, config_file(self.dir))
        if tokenizer is not None and tokenizer.file:
            keep_tokenizer(tokenizer, self.dir / self.TOKENIZER)

    def model(self, step: int | None = None) -> tuple[Config, ModelFns, int, object]:
        """(config, model functions, step, weights) of the latest checkpoint or of `step` (its EMA
        where it kept one), on this machine's devices (`serving_mesh`). A LoRA run's weights are its
        base (train.init_from's, as stored there) with the checkpoint's adapters."""
        cfg = dataclasses.replace(self.cfg, device_type="auto", mesh=serving_mesh(self.cfg.mesh))
        try:
            rt = runtime.start(cfg, announce=False)
        except MeshError:  # its tensor or expert sizes do not divide this machine's devices
            cfg = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=-1))
            rt = runtime.start(cfg, announce=False)
        cfg = final(cfg, rt.platform, rt.mesh, compiles=False)
        fns = model_fns(cfg, rt.mesh)
        trained, base = lora.split(fns.abstract_params) if cfg.train.lora.rank else (fns.abstract_params, None)
        checkpointer = Checkpointer(self.checkpoint_dir)
        try:
            step, params = checkpointer.restore_weights(trained, step)
        finally:
            checkpointer.close()
        if base is not None:
            params = lora.union(starting_weights(cfg.train.init_from, base, cfg), params)
        return cfg, fns, step, params

    def language_model(self) -> tuple[Config, ModelFns, object]:
        """(config, model functions, weights) of the latest checkpoint, for generate and export."""
        require_language(self.cfg.model, f"{self.dir} trained", "generate and convert take")
        cfg, fns, _, params = self.model()
        return cfg, fns, params


def serving_mesh(trained: MeshConfig) -> MeshConfig:
    """The mesh a run's model samples and is evaluated on, on one machine: the params split as in
    training (its tensor and expert sizes, fsdp over the rest of the devices), the rows of a batch
    over all of them; no pipeline stages or split sequences (decoding is one position at a time)."""
    return MeshConfig(data=1, fsdp=-1, tensor=trained.tensor, expert=trained.expert)


def starting_weights(source: str, abstract_params, cfg: Config):
    """train.init_from: the weights of a podtrain run directory (its EMA where it kept one) or of
    a Hugging Face checkpoint (a folder or a hub name), checked against this config's sizes and
    cast to the dtypes of `abstract_params` (LoRA's base: the compute dtype)."""
    if config_file(source).is_file():
        checkpointer = Checkpointer(Run.at(source).checkpoint_dir)
        saved = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=s.sharding), abstract_params)
        try:  # a run's weights are float32, its master copy
            weights = checkpointer.restore_weights(saved)[1]
            return jax.tree.map(lambda x, s: x.astype(s.dtype), weights, abstract_params)
        except CheckpointMismatch as e:
            changed = differences(source, cfg, ("model.",)) or "no model key"
            raise CheckpointError(
                f"train.init_from={source}: {e} Its config differs in: {changed}; give this run the same model keys."
            ) from None
        finally:
            checkpointer.close()
    folder = hf_checkpoint.hf_folder(source)
    hf = hf_checkpoint.read_hf_config(folder)
    keys = config_json.model_keys(hf, source)
    if cfg.model.name == keys["name"]:
        changed = config_json.shape_differences(keys, cfg.model)
    else:
        changed = [f"model.name ({keys['name']} there, {cfg.model.name} here)"]
    if changed:
        raise ConfigError(
            f"train.init_from={source} is a model of other sizes or options: {'; '.join(changed)}. Give this run "
            "its model keys (the config.yaml `podtrain convert --from-hf` writes has them)."
        )
    table, elsewhere = families.tensor_layout(hf)
    return hf_checkpoint.read_params(folder, abstract_params, table, source, elsewhere)
