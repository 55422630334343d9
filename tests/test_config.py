"""Config loading: YAML, overrides, environment mesh, flag aliases, recipes."""

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podtrain.cli import parser
from podtrain.config import Config, MeshConfig, load_config, mesh_from_env, resolve_auto, tiny_model_overrides
from podtrain.errors import ConfigError, MeshError
from podtrain.runtime.mesh import resolve_shape
from podtrain.train import optim

CONFIGS = Path(__file__).parent.parent / "configs"


def test_tiny_recipe_is_the_embedded_default():
    assert load_config(CONFIGS / "tiny.yaml") == Config()


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_loads(recipe):
    cfg = load_config(CONFIGS / recipe)
    if cfg.model.name in ("hrm", "trm") and "tiny" not in recipe:
        assert cfg.train.grad_clip == 0  # the references do not clip


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_small_model_fits_every_recipe(recipe):
    recipe_cfg = load_config(CONFIGS / recipe)
    cfg = load_config(CONFIGS / recipe, tiny_model_overrides())  # validates
    assert (cfg.model.d_model, cfg.model.n_layers) == (128, 4)
    assert (cfg.model.vocab_size, cfg.model.max_seq_len, cfg.train.seq_len) == (recipe_cfg.model.vocab_size, recipe_cfg.model.max_seq_len, recipe_cfg.train.seq_len)


def test_warmup_trains_from_the_first_step():
    t = load_config(None, ["train.steps=100", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr_ratio=0.1"]).train
    lr = optim.schedule(t)
    np.testing.assert_allclose([lr(0), lr(9), lr(99)], [1e-4, 1e-3, 1e-4], rtol=1e-5)
    assert optim.warmup_note(t) is None
    long = load_config(None, ["train.steps=5", "train.warmup_steps=10", "train.lr=1e-3"]).train
    np.testing.assert_allclose([optim.schedule(long)(0), optim.schedule(long)(4)], [1e-4, 5e-4], rtol=1e-5)
    assert "50% of train.lr" in optim.warmup_note(long)


@pytest.mark.parametrize("clip,norm", [(0, 5.0), (1.0, 1.0)])
def test_grad_clip_zero_turns_clipping_off(clip, norm):
    tx = optim.clipping(load_config(None, [f"train.grad_clip={clip}"]).train)
    grads = {"w": jnp.array([3.0, 4.0])}
    clipped, _ = tx.update(grads, tx.init(grads))
    np.testing.assert_allclose(optax.tree.norm(clipped), norm, rtol=1e-6)


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


def recipe(name):
    """The recipe's config and its parameter count, from shapes alone."""
    import jax
    from flax import nnx

    from podtrain.models import build_model

    cfg = resolve_auto(load_config(CONFIGS / name), "cpu")
    model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
    return cfg, sum(x.size for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "name,reference,tolerance",
    [
        ("llama_7b.yaml", 6_738_415_616, 0.001),  # Llama-2-7B
        ("mhc_3b.yaml", 3.0e9, 0.05),  # 3,036,658,098
        ("hrm_sudoku.yaml", 27_275_266, 0.05),  # the papers' counts, +512 for the puzzle embedding
        ("trm_sudoku.yaml", 5_028_866, 0.05),
        ("trm_sudoku_pod.yaml", 5_028_866, 0.05),
    ],
)
def test_recipe_has_its_reference_size(name, reference, tolerance):
    n = recipe(name)[1]
    assert abs(n - reference) / reference < tolerance, n


def test_recipes_keep_their_setup():
    llama, mhc, trm, pod = (load_config(CONFIGS / f) for f in ("llama_7b.yaml", "mhc_3b.yaml", "trm_sudoku.yaml", "trm_sudoku_pod.yaml"))
    assert (llama.mesh.data, llama.mesh.fsdp, llama.mesh.tensor) == (4, 4, 2)
    assert (mhc.model.vocab_size, mhc.train.batch_size, mhc.model.mhc.streams) == (49152, 32, 4)
    assert (mhc.mesh.data, mhc.mesh.fsdp, mhc.mesh.tensor) == (2, 2, 2)
    assert load_config(CONFIGS / "mhc_tiny.yaml").model.name == "mhc"
    assert (trm.train.batch_size, trm.train.ema, trm.model.trm.mlp_t) == (768, 0.999, True)
    assert (pod.train.batch_size, pod.mesh.data, pod.model) == (6144, -1, trm.model)
