"""Loading a config: the family's defaults, a YAML file, the environment, setup-guide flags and
`key=value` overrides, checked against the schema, with `auto` values resolved.

Precedence, lowest first: the family's defaults (for llama, the embedded tiny job), a YAML file,
`TPU_MESH_CONFIG`/`TPU_AXIS_NAMES`, then command-line flags and overrides. OmegaConf checks keys,
types and choices (`checks.py` the names of registries); this module turns their exceptions into
messages a user can act on. It sits above the models (which family a config is) and the data
(`model.vocab_size=auto`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from podtrain import storage
from podtrain.axes import AXES, MESH_AXIS_ALIASES
from podtrain.config.keys import all_keys, leaves
from podtrain.config.schema import Config
from podtrain.data.registry import SOURCES
from podtrain.data.tokenizer import vocab_for
from podtrain.errors import ConfigError
from podtrain.models import MODELS
from podtrain.program.checks import switches, validate
from podtrain.program.tasks.registry import train_config


class _Yaml(yaml.SafeLoader):
    """YAML as config values are typed: only true and false are booleans (as in YAML 1.2), so
    `off`, `on`, `yes` and `no` stay the words they are (compile_cache=off means off)."""


_Yaml.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def default_config(model: str = "llama") -> Config:
    """The defaults of model family `model`: its model keys and its task's train keys. With
    `llama`, the embedded tiny job."""
    if model not in MODELS:
        match = difflib.get_close_matches(str(model), MODELS, n=1)
        hint = f" Did you mean {match[0]}?" if match else ""
        raise ConfigError(f"model.name={model!r} is not a known model; choose one of: {', '.join(MODELS)}.{hint}")
    family = MODELS[model]
    return Config(model=family.config(), train=train_config(family)())


def _read_yaml(path: str | Path) -> dict:
    path = storage.path(path)
    if not path.is_file():
        raise ConfigError(
            f"Config file {path} does not exist. Pass a YAML file (see configs/) or no file for the default job."
        )
    try:
        data = yaml.load(path.read_text(), _Yaml)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"Config file {path} is not valid YAML: {e}. Fix the file (indentation and `key: value` pairs)."
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {path} must hold a mapping of keys (like `train: {{steps: 100}}`), "
            f"not a {type(data).__name__}."
        )
    return data


def mesh_from_env(environ=os.environ) -> list[str]:
    """`TPU_MESH_CONFIG="4,4,2"` with `TPU_AXIS_NAMES="data,model,fsdp"` as mesh overrides."""
    sizes = environ.get("TPU_MESH_CONFIG")
    if not sizes:
        return []
    names = environ.get("TPU_AXIS_NAMES", "data,fsdp,tensor").split(",")
    sizes = sizes.split(",")
    if len(names) != len(sizes):
        raise ConfigError(
            f"TPU_MESH_CONFIG={','.join(sizes)} has {len(sizes)} sizes but TPU_AXIS_NAMES has {len(names)} names; "
            "give one name per size."
        )
    overrides = []
    for name, size in zip(names, sizes):
        axis = MESH_AXIS_ALIASES.get(name.strip(), name.strip())
        if axis not in AXES:
            raise ConfigError(
                f"TPU_AXIS_NAMES names an unknown mesh axis `{name}`; use {', '.join(AXES)} (or the aliases "
                f"{', '.join(f'{a} for {b}' for a, b in MESH_AXIS_ALIASES.items())})."
            )
        overrides.append(f"mesh.{axis}={size.strip()}")
    return overrides


# Keys that moved, by their old names: still read, where they now live, with a note.
MOVED = {"model.context_attention": "context.strategy"}


def canonical(data: dict, where: str) -> dict:
    """`data` in podtrain's names: the mesh's axes by the field's names (`cp: 4`) as podtrain's
    (`context: 4`), and each key that moved (`MOVED`) at its new place, said once."""
    data = {name: dict(value) if isinstance(value, dict) else value for name, value in data.items()}
    if isinstance(data.get("mesh"), dict):
        data["mesh"] = {MESH_AXIS_ALIASES.get(name, name): size for name, size in data["mesh"].items()}
    for old, new in MOVED.items():
        (section, name), (to, new_name) = old.split("."), new.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            value = data[section].pop(name)
            data.setdefault(to, {}).setdefault(new_name, value)
            print(f"[podtrain] {old} in {where} is now {new}; read as {new}={value}.", file=sys.stderr)
    return data


def _select(layers: list[Any], name: str):
    """The value `name` ends on in the layers, before any type checks (None if unset)."""
    try:
        return OmegaConf.select(OmegaConf.merge(*layers), name, default=None) if layers else None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def _choices(defaults: Config, name: str) -> tuple | None:
    """The values a `Literal` key or a key naming a registry's entries (or each item of a list of
    them) allows, or None for another kind of key."""
    name = re.sub(r"\[\d+\]$", "", name)
    if (named := switches().get(name)) is not None:
        return named
    kind = _field_type(defaults, name)
    if typing.get_origin(kind) is list:
        kind = typing.get_args(kind)[0]
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None


def _is_list(defaults: Config, name: str) -> bool:
    return typing.get_origin(_field_type(defaults, name)) is list


def _merge(defaults: Config, layers: list[Any]) -> Config:
    schema = OmegaConf.structured(defaults)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, *layers))
    except ConfigKeyError as e:
        name = e.full_key or str(e.key)
        match = difflib.get_close_matches(name, all_keys(defaults), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(
            f"Unknown config key `{name}` for model.name={defaults.model.name}.{hint} "
            "docs/configuration.md lists the keys of each model."
        ) from None
    except ValidationError as e:
        if _is_list(defaults, e.full_key):
            example = ",".join(_choices(defaults, e.full_key) or ("A", "B"))
            raise ConfigError(
                f"Config key `{e.full_key}` takes a list, e.g. {e.full_key}=[{example}]; got {e.value!r}."
            ) from None
        if choices := _choices(defaults, e.full_key):
            raise ConfigError(
                f"Config key `{e.full_key}` is {e.value!r}; choose one of: {', '.join(choices)}."
            ) from None
        expected = type(OmegaConf.select(schema, e.full_key)).__name__ if e.full_key else "?"
        raise ConfigError(
            f"Config key `{e.full_key}` got {e.value!r}, which is not a valid {expected}. "
            f"Give a value of type {expected}."
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config: {e.msg}") from None


def parse_overrides(items: list[str]) -> dict:
    """`key=value` items as a nested mapping, each value read as YAML would read it in a file."""
    tree: dict = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"Override `{item}` is not of the form key=value (for example train.steps=100).")
        name, text = item.split("=", 1)
        *sections, last = name.strip().split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"Override `{item}` sets a key inside `{section}`, which another override sets whole."
                )
        try:
            node[last] = yaml.load(text, _Yaml) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"Could not read the value of override `{item}`: {e}.") from None
    return tree


def _field_type(defaults: Config, name: str):
    """The annotated type of a dotted key, or None where the schema has no such key."""
    *sections, last = name.split(".")
    node = defaults
    for section in sections:
        node = getattr(node, section, None)
    return _hints(type(node)).get(last) if dataclasses.is_dataclass(node) else None


@functools.cache
def _hints(cls: type) -> dict:
    """A dataclass's annotations, evaluated once: typing.get_type_hints re-reads them on every call."""
    return typing.get_type_hints(cls)


def flatten(node: dict, prefix: str = "") -> dict:
    """{'a.b': value} of nested {'a': {'b': value}}."""
    flat = {}
    for name, value in node.items():
        flat.update(flatten(value, f"{prefix}{name}.") if isinstance(value, dict) else {prefix + name: value})
    return flat


def check_words(defaults: Config, data: dict, where: str) -> None:
    """A key that takes a word, given a boolean (YAML's `true` or `false`), is refused naming the
    key and its values, rather than turned into the string 'True' or 'False'."""
    for name, value in flatten(data).items():
        kind, words = _field_type(defaults, name), _choices(defaults, name) or ()
        if isinstance(value, bool) and (words or str in (kind, *typing.get_args(kind))):  # str, str | None
            choices = f"one of: {', '.join(words)}" if words else "a word or a path, not a boolean"
            field = dict((k, f) for k, f, _ in leaves(defaults)).get(name)
            doc = f" ({field.metadata['doc']})" if field is not None and "doc" in field.metadata else ""
            raise ConfigError(
                f"Config key `{name}` in {where} is the boolean {str(value).lower()}; it takes {choices}{doc}."
            )


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), environ=os.environ, small_model: bool = False
) -> Config:
    """The config of `path` with `overrides`, checked against the keys of its model family.
    `small_model` swaps in the family's debug flavor (the tiny job's layer sizes); the vocabulary,
    sequence length and precision stay the recipe's, so its data and train.seq_len still fit."""
    layers = []
    if path:
        data = canonical(_read_yaml(path), str(path))
        check_structure(data, str(path))
        layers.append(OmegaConf.create(data))
    override = canonical(parse_overrides(mesh_from_env(environ) + list(overrides)), "the overrides")
    check_structure(override, "the overrides")
    try:
        layers.append(OmegaConf.create(override))
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not parse overrides: {e.msg}") from None
    name = str(_select(layers, "model.name") or "llama")
    defaults = default_config(name)
    for layer, where in zip(layers, [str(path), "the overrides"] if path else ["the overrides"]):
        check_words(defaults, OmegaConf.to_container(layer), where)
    auto_vocab = _select(layers, "model.vocab_size") == "auto"
    for layer in layers if auto_vocab else []:  # a placeholder until the data is known
        if OmegaConf.select(layer, "model.vocab_size") == "auto":
            OmegaConf.update(layer, "model.vocab_size", 1)
    if small_model:
        debug = OmegaConf.create({"model": MODELS[name].debug})
        layers.insert(len(layers) - 1, debug)
    cfg = _merge(defaults, layers)
    validate(cfg)  # the data's source and path too, before its tokenizer is read
    if auto_vocab:
        cfg.model.vocab_size = auto_vocab_size(cfg)
    return cfg


def auto_vocab_size(cfg: Config) -> int:
    """`model.vocab_size=auto`: the data's tokenizer's vocabulary rounded up to a multiple of 128."""
    source = SOURCES[cfg.data.source]
    if source.vocab:
        raise ConfigError(
            f"model.vocab_size=auto reads a tokenizer's vocabulary; data.source={cfg.data.source} has a fixed one "
            f"({source.vocab}): give it as a number."
        )
    return vocab_for(source.tokenizer(cfg.data))


def check_structure(data: dict, where: str) -> None:
    """Sections are mappings of single values: say so, naming the key, before OmegaConf's errors would."""
    sections = sorted(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name)))
    for name, value in data.items():
        section = dataclasses.is_dataclass(getattr(Config(), str(name), None))
        if isinstance(value, dict) and not hasattr(Config(), str(name)):
            inner = next(iter(value), "KEY")
            raise ConfigError(
                f"Unknown config section `{name}` (as in `{name}.{inner}`) in {where}; the sections are "
                f"{', '.join(sections)}. docs/configuration.md lists their keys."
            )
        if section and not isinstance(value, dict):
            raise ConfigError(
                f"`{name}` in {where} must be a mapping of keys (like `{name}: {{key: value}}`), not `{value!r}`."
            )
        for item_key, item in value.items() if section else [(None, value)]:
            full = f"{name}.{item_key}" if item_key is not None else str(name)
            subsection = section and dataclasses.is_dataclass(getattr(getattr(Config(), name), str(item_key), None))
            # the family is not known yet: a key that is a list in any family may hold one
            if (isinstance(item, dict) and not subsection) or (
                isinstance(item, list) and not any(_is_list(default_config(family), full) for family in MODELS)
            ):
                raise ConfigError(
                    f"Config key `{full}` in {where} must be a single value (a number, string or boolean), "
                    f"not `{item!r}`."
                )
