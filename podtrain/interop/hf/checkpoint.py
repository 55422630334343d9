"""Hugging Face checkpoints in safetensors: their folder (local or from the hub), their tensors
read straight onto a mesh, and podtrain weights written back, by a family's table of names
(`families.py`).

Reading streams: the files are memory-mapped and each device's shard of a parameter is cut from
one source tensor at a time (`jax.make_array_from_callback`), so the host never holds the model.
Nothing is unpickled or executed: `.bin` checkpoints are refused.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from podtrain import storage
from podtrain.errors import CheckpointError, ConfigError
from podtrain.interop.hf.tensors import AS_IS
from podtrain.trees import leaf_name

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size: larger exports are sharded with an index
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older exports carry; recomputed, not learned
# The model's stacks of layers, bottom first (an MoE's dense layers, then its expert layers): a
# checkpoint numbers its layers {i} through them all.
STACKS = ("dense_layers", "layers")


def hf_folder(source: str) -> Path:
    """A local folder with config.json and safetensors, a bucket's folder copied into this host's
    cache, or a hub model's files fetched into the HF cache."""
    path = storage.local_copy(source)
    if not path.is_dir():
        if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise ConfigError(
                f"{source} is neither a folder with a Hugging Face checkpoint (config.json and *.safetensors) nor a "
                "hub model name like HuggingFaceTB/SmolLM-135M."
            )
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source, allow_patterns=HUB_FILES))
        except Exception as e:  # noqa: BLE001 - not found, gated and offline are all "cannot get it"
            raise ConfigError(
                f"Could not get the model `{source}` from the Hugging Face hub: {type(e).__name__}. "
                "Check the name, that this machine reaches huggingface.co (or set HF_TOKEN), or give a local folder "
                "with config.json and *.safetensors."
            ) from None
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{path} has no config.json; give the folder of a Hugging Face model (config.json and *.safetensors)."
        )
    return path


def read_hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


class SafeTensors:
    """A checkpoint's tensors by name across its safetensors files (one, or an index and shards),
    memory-mapped, each read when asked for."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        if (folder / INDEX).is_file():
            where = {
                name: folder / file for name, file in json.loads((folder / INDEX).read_text())["weight_map"].items()
            }
        else:
            files = sorted(folder.glob("*.safetensors"))
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            if not files:
                hint = (
                    f"; its {', '.join(pickles)} are pickles, which podtrain never loads (they can run code). "
                    "Convert them first, e.g. `transformers` save_pretrained(..., safe_serialization=True)"
                    if pickles
                    else ""
                )
                raise CheckpointError(f"{folder} has no *.safetensors files{hint}.")
            where = {}
            for file in files:
                with safe_open(file, "numpy") as f:
                    where |= dict.fromkeys(f.keys(), file)
        self._stack = ExitStack()
        self._files = {
            file: self._stack.enter_context(safe_open(file, "numpy")) for file in sorted(set(where.values()))
        }
        self.where = where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor, or only its rows start..stop-1 (one part of a fused tensor)."""
        if rows is None:
            return self._files[self.where[name]].get_tensor(name)
        return self._files[self.where[name]].get_slice(name)[rows[0] : rows[1]]

    def close(self) -> None:
        self._stack.close()


def _hf_shape(shape: tuple[int, ...], in_axes: int | None) -> tuple[int, ...]:
    """A podtrain array's shape as torch stores it: (out, in) for a Linear weight."""
    if in_axes is AS_IS:
        return shape
    return (math.prod(shape[in_axes:]), math.prod(shape[:in_axes])) if in_axes else (math.prod(shape),)


def _lead(table: dict, path: str) -> int:
    """How many leading axes of a podtrain array index its tensors: the layer's, the expert's."""
    return sum(f"{{{axis}}}" in table[path][0] for axis in "ie")


def _one(table: dict, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one source tensor of a podtrain array: a layer's (an expert's), for the stacked ones."""
    return shape[_lead(table, path) :]


def _rows(table: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int, int]]:
    """(first row, end row, all rows of the tensor) of each param that is a part of a fused tensor;
    `shapes` are one layer's shapes of the params the model has."""
    spans = {}
    for name in {entry[0] for entry in table.values() if len(entry) > 2}:
        parts = sorted((table[p][2], p) for p in shapes if table[p][0] == name)
        rows = [_hf_shape(shapes[p], table[p][1])[0] for _, p in parts]
        ends = np.cumsum(rows)
        spans |= {p: (int(end - n), int(end), int(ends[-1])) for (_, p), n, end in zip(parts, rows, ends)}
    return spans


def _indices(table: dict, path: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The index of each of a podtrain array's tensors along its leading axes, in order."""
    return list(np.ndindex(shape[: _lead(table, path)]))


def _names(table: dict, path: str, shape: tuple[int, ...], first: dict[str, int]) -> list[str]:
    """The names of a podtrain array's tensors, in `_indices` order; `first`: each stack's first layer."""
    below = first.get(path.split("/")[0], 0)
    return [
        table[path][0].format(**dict(zip("ie", (index[0] + below, *index[1:]) if index else index)))
        for index in _indices(table, path, shape)
    ]


def _first_layers(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The checkpoint's number of each stack's first layer, from the params' paths and shapes."""
    first, below = {}, 0
    for stack in STACKS:
        first[stack] = below
        below += next((shape[0] for path, shape in shapes.items() if path.startswith(stack + "/")), 0)
    return first


def read_params(folder: Path, abstract_params, table: dict, where: str, elsewhere: tuple[str, ...] = ()):
    """The params of `abstract_params` (ShapeDtypeStructs with shardings) from an HF checkpoint
    whose tensors `table` names, each device's shard cut from one source tensor at a time and cast
    to the param's dtype. A tensor the params have no place for is an error, never dropped, unless
    its name starts with one of `elsewhere` (a multimodal checkpoint's vision tower)."""
    tensors = SafeTensors(folder)
    try:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        paths = [leaf_name(p) for p, _ in leaves]
        if unnamed := [p for p in paths if p not in table]:
            raise CheckpointError(
                f"{where} has no place for this model config's {', '.join(unnamed)} (a Hugging Face model of its type "
                "has none); leave out the model keys that make them (as model.router_bias_update_rate does)."
            )
        shapes = {path: leaf.shape for path, (_, leaf) in zip(paths, leaves)}
        rows = _rows(table, {path: _one(table, path, shape) for path, shape in shapes.items()})
        first = _first_layers(shapes)
        wanted = {name for p in paths for name in _names(table, p, shapes[p], first)}
        missing = sorted(wanted - set(tensors.where), key=len)
        tied_copy = {table["head"][0]} if "head" not in paths else set()  # some tied exports keep a copy
        extra = sorted(
            n
            for n in set(tensors.where) - wanted - tied_copy
            if not n.endswith(IGNORED) and not n.startswith(elsewhere)
        )
        if missing or extra:
            listing = (
                (f"it lacks {', '.join(missing[:3])}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"it has tensors this model has no place for: {', '.join(extra[:3])}" if extra else "")
            )
            raise CheckpointError(f"{where} does not hold the tensors of this model config: {listing}.")
        arrays = []
        for path, (_, leaf) in zip(paths, leaves):
            in_axes, names, lead = table[path][1], _names(table, path, leaf.shape, first), _lead(table, path)
            one = (
                jax.ShapeDtypeStruct(
                    _one(table, path, leaf.shape),
                    leaf.dtype,
                    sharding=NamedSharding(leaf.sharding.mesh, PartitionSpec(*leaf.sharding.spec[lead:])),
                )
                if lead
                else leaf
            )
            expected = _hf_shape(one.shape, in_axes)
            if path in rows:  # the whole fused tensor
                expected = (rows[path][2], *expected[1:])
            for name in names:
                if tensors.shape(name) != expected:
                    raise CheckpointError(
                        f"{where}: {name} is {list(tensors.shape(name))}, where this config needs {list(expected)}."
                    )
            part = rows[path][:2] if path in rows else None
            placed = (_place(tensors.get(name, part), one, in_axes) for name in names)
            arrays.append(_stacked(placed, leaf, lead) if lead else next(placed))
        return jax.tree_util.tree_unflatten(treedef, arrays)
    finally:
        tensors.close()


def _place(tensor: np.ndarray, target: jax.ShapeDtypeStruct, in_axes: int) -> jax.Array:
    """One source tensor in podtrain's layout, each device given its shard in the target dtype."""
    tensor = (tensor.T if in_axes else tensor).reshape(target.shape)  # a FLAT or AS_IS one is not transposed
    return jax.make_array_from_callback(target.shape, target.sharding, lambda index: tensor[index].astype(target.dtype))


def _stacked(pieces, leaf: jax.ShapeDtypeStruct, lead: int) -> jax.Array:
    """A (layers, [experts,] ...) param assembled where it lives, one tensor written in place at a
    time (its first `lead` axes index them, in order), so that the host never holds the stack."""
    empty = jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.sharding)
    put = jax.jit(
        lambda stack, piece, index: jax.lax.dynamic_update_slice(
            stack, piece.reshape((1,) * lead + piece.shape), (*index, *(0,) * piece.ndim)
        ),
        donate_argnums=0,
        out_shardings=leaf.sharding,
    )
    stack = empty()
    for index, piece in zip(np.ndindex(leaf.shape[:lead]), pieces):
        stack = put(stack, piece, tuple(jnp.int32(i) for i in index))
    return stack


def write_params(params, out: Path, table: dict, dtype: str, stem: str = "model") -> list[str]:
    """`params` under `table`'s names in torch's layouts in `dtype`: one model.safetensors (`stem`), or
    shards of at most SHARD_BYTES with model.safetensors.index.json. Returns the files written."""
    from safetensors.numpy import save_file

    np_dtype = np.dtype(jnp.dtype(dtype))
    flat = {leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    rows = _rows(table, {path: _one(table, path, x.shape) for path, x in flat.items()})
    first = _first_layers({path: x.shape for path, x in flat.items()})
    fused = {}  # the parts of each fused tensor, in their order
    for path in sorted(rows, key=lambda p: rows[p][0]):
        fused.setdefault(table[path][0], []).append(path)

    def piece(path: str, index: tuple[int, ...]) -> np.ndarray:
        """The tensor at `index` (a layer's, an expert's; () for the only one) of param `path` in torch's layout."""
        x, in_axes = flat[path], table[path][1]
        shape = _hf_shape(_one(table, path, x.shape), in_axes)
        a = np.asarray(jax.device_get(x[index]))
        return a.reshape(shape[::-1]).T if in_axes else a.reshape(shape)

    def entries():
        """(name, shape, how to make it), in the order transformers lists them."""
        for path, x in flat.items():
            parts = fused.get(table[path][0], [path])
            if path != parts[0]:
                continue  # written with the first part of its tensor
            shape = _hf_shape(_one(table, path, x.shape), table[path][1])
            shape = (rows[path][2], *shape[1:]) if path in rows else shape
            for index, name in zip(_indices(table, path, x.shape), _names(table, path, x.shape, first)):

                def make(index=index, parts=parts):
                    return np.ascontiguousarray(np.concatenate([piece(p, index) for p in parts]).astype(np_dtype))

                yield name, shape, make

    shards, size, total = [[]], 0, 0
    for entry in entries():
        nbytes = math.prod(entry[1]) * np_dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size, total = size + nbytes, total + nbytes
    names = (
        [f"{stem}.safetensors"]
        if len(shards) == 1
        else [f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file({name: make() for name, _, make in shard}, out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys((name for name, _, _ in shard), file)
    if len(names) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names
