"""Config loading: YAML, overrides, environment mesh, flag aliases, recipes."""

import dataclasses
from pathlib import Path

import pytest

from podtrain.cli import parser
from podtrain.config import Config, MeshConfig, load_config, mesh_from_env
from podtrain.errors import ConfigError, MeshError
from podtrain.runtime.mesh import resolve_shape

CONFIGS = Path(__file__).parent.parent / "configs"


def test_tiny_recipe_is_the_embedded_default():
    assert load_config(CONFIGS / "tiny.yaml") == Config()


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_loads(recipe):
    load_config(CONFIGS / recipe)


def test_overrides_take_precedence_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\n  lr: 0.01\n")
    cfg = load_config(path, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.lr) == (9, 0.01)


def test_tpu_mesh_env_with_aliases():
    env = {"TPU_MESH_CONFIG": "4,4,2", "TPU_AXIS_NAMES": "data,model,fsdp"}
    assert mesh_from_env(env) == ["mesh.data=4", "mesh.tensor=4", "mesh.fsdp=2"]
    cfg = load_config(None, ["mesh.fsdp=1"], environ=env)
    assert dataclasses.astuple(cfg.mesh) == (4, 1, 4)  # the command line wins over the environment


def test_setup_guide_flags_map_to_keys():
    args = parser().parse_args(["train", "--batch-size", "32", "--mesh-tp", "2", "--learning-rate", "1e-3", "--use-small-model", "train.steps=5"])
    assert args.flags == {"--batch-size": "32", "--mesh-tp": "2", "--learning-rate": "1e-3"}
    assert args.use_small_model and args.overrides == []


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_config(None, ["train.batch_szie=4"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=many"])


def test_mesh_minus_one_takes_the_rest():
    assert resolve_shape(MeshConfig(-1, 2, 2), 8) == (2, 2, 2)
    assert resolve_shape(MeshConfig(1, -1, 1), 8) == (1, 8, 1)
    with pytest.raises(MeshError, match="8 devices cannot"):
        resolve_shape(MeshConfig(-1, 3, 1), 8)
    with pytest.raises(MeshError, match="needs 6 devices but 8"):
        resolve_shape(MeshConfig(3, 2, 1), 8)


def test_llama_7b_recipe_has_7b_parameters():
    import jax
    from flax import nnx

    from podtrain.models import build_model

    cfg = load_config(CONFIGS / "llama_7b.yaml")
    model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert abs(n - 6.738e9) / 6.738e9 < 0.001  # Llama-2-7B: 6,738,415,616
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (4, 4, 2)


def test_mhc_3b_recipe_has_3b_parameters():
    import jax
    from flax import nnx

    from podtrain.models import build_model

    cfg = load_config(CONFIGS / "mhc_3b.yaml")
    model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert abs(n - 3.0e9) / 3.0e9 < 0.05, n  # 3,036,658,098
    assert (cfg.model.vocab_size, cfg.train.batch_size, cfg.model.mhc.streams) == (49152, 32, 4)
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 2)
    assert load_config(CONFIGS / "mhc_tiny.yaml").model.name == "mhc"
