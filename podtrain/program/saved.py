"""The config a run keeps in RUN_DIR/config.yaml: written whole, read back, compared with another."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from podtrain import storage
from podtrain.config.schema import Config
from podtrain.errors import ConfigError
from podtrain.program.load import flatten, load_config


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """Written whole or not at all, so a kill leaves the last one."""
    storage.write_text(path, to_yaml(cfg))


CONFIG = "config.yaml"  # in a run directory: the config the run trains with


def config_file(run_dir: str | Path) -> Path:
    return storage.path(run_dir) / CONFIG


def run_config(run_dir: str | Path) -> Config:
    """The config a run was trained with, from RUN_DIR/config.yaml."""
    path = config_file(run_dir)
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} is not a run directory (no config.yaml); give the run_dir of a `podtrain train` run."
        )
    return load_config(path)


def differences(run_dir: str | Path, cfg: Config, sections: tuple[str, ...] = ("",)) -> str:
    """'key (old there, new here); ...' for each key of `sections` (prefixes such as "model.") whose
    value in the run's config.yaml differs from cfg's; empty where the run keeps none."""
    path = config_file(run_dir)
    if not path.is_file():
        return ""
    old, new = flatten(yaml.safe_load(path.read_text()) or {}), flatten(yaml.safe_load(to_yaml(cfg)))
    return "; ".join(
        f"{name} ({old.get(name)} there, {new.get(name)} here)"
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name) and name.startswith(sections)
    )
