"""podtrain from Python (a notebook, a script): `from podtrain import api`, then `load`, `train`,
`plan`, `open_run` and `plot`, each the command of the same name over the same functions
(docs/api.md). Errors are `PodtrainError`s, never an exit. A module, not names on the package:
`import podtrain` stays free of JAX, and `podtrain.train` is a subpackage."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax

from podtrain.config.schema import Config
from podtrain.errors import PodtrainError
from podtrain.planning import plan as planning
from podtrain.planning import report, targets
from podtrain.program.load import load_config
from podtrain.program.sampler import Sampling
from podtrain.runtime import use_compile_cache
from podtrain.runtime.devices import hide_absent_tpu
from podtrain.tools import generate as generating
from podtrain.tools.plot import plot_runs
from podtrain.train import checkpoint, metrics, run
from podtrain.train.loop import train as train_loop

__all__ = ["Plan", "PodtrainError", "Run", "load", "open_run", "plan", "plot", "train"]


def load(path: str | Path | None = None, *overrides: str, small_model: bool = False) -> Config:
    """The config `podtrain train PATH KEY=VALUE ...` trains: PATH (None: the embedded tiny job)
    with dotted `key=value` overrides, checked as the CLI checks them."""
    if path is not None and "=" in str(path):  # load("train.steps=5"): overrides alone, as on the command line
        path, overrides = None, (str(path), *overrides)
    return load_config(path, list(overrides), small_model=small_model)


def train(cfg: Config) -> dict:
    """Train (or resume) to cfg.train.steps into cfg.run_dir, as `podtrain train`; the last metrics."""
    hide_absent_tpu()  # as the CLI starts JAX: no libtpu where there is no TPU
    with warnings.catch_warnings():  # rich's progress bar in a notebook without ipywidgets: the log lines stay
        warnings.filterwarnings("ignore", 'install "ipywidgets"')
        return train_loop(cfg)


@dataclass(repr=False)
class Plan:
    """`podtrain plan`'s answer: `fits`, `memory`, `step_time`, `tokens_per_sec`, `mfu` and the rest
    of planning.plan.Plan; str() and repr() are the CLI's report."""

    result: planning.Plan

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy's and pickle's questions are the wrapper's
            raise AttributeError(name)
        return getattr(self.result, name)

    def report(self, top: int = 0) -> str:
        """The report `podtrain plan --top N` prints."""
        return report.report(self.result, top)

    def as_json(self, top: int = 0) -> dict:
        """What `podtrain plan --json` prints."""
        return report.as_json(self.result, top)

    __str__ = __repr__ = report  # a notebook shows the report


def plan(cfg: Config, target: str) -> Plan:
    """Compile cfg's train step for `target` (`podtrain plan --target`'s names: v6e-8, v4-32,
    2xv6e-256, h100x8, cpu:N) and say whether it fits; a job that does not also gets its remedy."""
    if count := targets.cpu_count(target.strip().lower()):  # cpu:N: N host devices, if JAX has not started
        with contextlib.suppress(RuntimeError):  # it has: targets.target says how many it needs and has
            jax.config.update("jax_num_cpu_devices", count)
    hide_absent_tpu()
    found = targets.target(target)
    if found.platform == "cpu":  # as `podtrain plan`: a CPU plan run twice is read back from the cache
        use_compile_cache(cfg.compile_cache)
    return Plan(planning.plan(cfg, found))


class Run:
    """A run directory (`dir`, `cfg`): its metrics and checkpoints, and text from its latest checkpoint."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = run.Run.at(run_dir)  # a ConfigError if it has no config.yaml
        self.dir, self.cfg, self._model = self.run.dir, self.run.cfg, None  # the weights: at the first generate

    @property
    def metrics(self) -> list[dict]:
        """metrics.jsonl's records, oldest first."""
        return metrics.read_metrics(self.dir)

    def checkpoints(self) -> list[dict]:
        """`podtrain checkpoints --json`: each checkpoint's step, time, size, digest, verified."""
        return checkpoint.describe(self.run.checkpoint_dir)

    def generate(
        self,
        prompt: str = "",
        max_tokens: int = 200,
        temperature: float = 0.8,
        seed: int = 0,
        chat: str | None = None,
        system: str | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> str:
        """`podtrain generate`'s text from the latest checkpoint (loaded at the first call): the prompt
        and its continuation (temperature 0: greedy), or the reply alone to a `chat` message."""
        hide_absent_tpu()
        self._model = self._model or self.run.language_model()
        sampling = Sampling(temperature, top_k, top_p)
        return generating.generate(self.run, prompt, chat, system, max_tokens, sampling, seed, self._model)

    def __repr__(self) -> str:
        return f"<Run {self.dir}: {self.cfg.model.name}>"


def open_run(run_dir: str | Path) -> Run:
    """The run `podtrain train` wrote to run_dir (or `convert --from-hf` made)."""
    return Run(run_dir)


def plot(*run_dirs: str | Path, out: str | Path | None = None) -> Path:
    """`podtrain plot`: the runs' curves in one PNG (default RUN_DIR/curves.png); its path."""
    return plot_runs([str(d) for d in run_dirs], str(out) if out else None)
