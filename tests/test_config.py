"""Config loading: YAML, overrides, environment mesh, flag aliases, recipes."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from podtrain.cli import _parse, parser
from podtrain.config.parallel import MeshConfig
from podtrain.errors import ConfigError, MeshError
from podtrain.program.checks import resolve_auto
from podtrain.program.load import default_config, load_config, mesh_from_env
from podtrain.program.saved import save_config
from podtrain.runtime.mesh import resolve_shape

from helpers import FAMILIES

CONFIGS = Path(__file__).parent.parent / "configs"


def test_tiny_recipe_is_the_embedded_default():
    assert load_config(CONFIGS / "tiny.yaml") == default_config() == load_config(None)


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_loads_and_round_trips(recipe, tmp_path):
    """A run saves its config and `generate` and resumes load it back: it must come back equal,
    as the family's config class with the recipe's values (a key of another family would fail)."""
    from podtrain.models import MODELS

    cfg = load_config(CONFIGS / recipe)
    assert type(cfg.model) is MODELS[cfg.model.name].config
    for key, value in yaml.safe_load((CONFIGS / recipe).read_text())["model"].items():
        assert getattr(cfg.model, key) == value, key
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    if cfg.model.name in ("hrm", "trm") and "tiny" not in recipe:
        assert cfg.train.grad_clip == 0  # the references do not clip


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_small_model_fits_every_recipe(recipe):
    recipe_cfg = load_config(CONFIGS / recipe)
    cfg = load_config(CONFIGS / recipe, small_model=True)  # validates
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff) == (128, 4, 384)
    if hasattr(cfg.model, "n_layers"):
        assert (cfg.model.n_layers, cfg.model.n_kv_heads) == (4, 2)
    assert (cfg.model.vocab_size, cfg.model.max_seq_len, cfg.train) == (
        recipe_cfg.model.vocab_size,
        recipe_cfg.model.max_seq_len,
        recipe_cfg.train,
    )


def test_each_family_has_only_its_keys():
    from podtrain.config.keys import all_keys

    keys = {
        name: {k for k in all_keys(default_config(name)) if k.startswith(("model.", "train."))} for name in FAMILIES
    }
    assert {
        "model.n_layers",
        "model.n_kv_heads",
        "model.tie_embeddings",
        "train.seq_len",
        "train.sample_tokens",
    } <= keys["llama"]
    assert keys["mhc"] - keys["llama"] == {
        "model.streams",
        "model.sinkhorn_iters",
        "model.projection",
        "model.alpha_init",
    }
    assert keys["hrm"] - keys["trm"] == {"model.H_layers"} and keys["trm"] - keys["hrm"] == {"model.mlp_t"}
    ignored_before = {
        "model.n_layers",
        "model.n_kv_heads",
        "model.tie_embeddings",
        "train.seq_len",
        "train.sample_tokens",
    }
    assert not ignored_before & (keys["hrm"] | keys["trm"])
    with pytest.raises(ConfigError, match="model.name='lama' is not a known model.*Did you mean llama"):
        load_config(None, ["model.name=lama"])


def test_overrides_take_precedence_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\n  lr: 0.01\n")
    cfg = load_config(path, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.lr) == (9, 0.01)


def test_tpu_mesh_env_with_aliases():
    env = {"TPU_MESH_CONFIG": "4,4,2", "TPU_AXIS_NAMES": "data,model,fsdp"}
    assert mesh_from_env(env) == ["mesh.data=4", "mesh.tensor=4", "mesh.fsdp=2"]
    cfg = load_config(None, ["mesh.fsdp=1"], environ=env)
    given = {name: size for name, size in dataclasses.asdict(cfg.mesh).items() if size != 1}
    assert given == {"data": 4, "tensor": 4}  # the command line wins over the environment


def test_setup_guide_flags_map_to_keys():
    args = parser().parse_args(
        [
            "train",
            "--batch-size",
            "32",
            "--mesh-tp",
            "2",
            "--learning-rate",
            "1e-3",
            "--use-small-model",
            "train.steps=5",
        ]
    )
    assert args.flags == {"--batch-size": "32", "--mesh-tp": "2", "--learning-rate": "1e-3"}
    assert args.use_small_model and args.overrides == []


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_config(None, ["train.batch_szie=4"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=many"])


def test_mesh_minus_one_takes_the_rest():
    assert resolve_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == {
        "data": 2,
        "stage": 1,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    assert tuple(resolve_shape(MeshConfig(data=1, fsdp=-1, tensor=1), 8).values()) == (1, 1, 8, 1, 1, 1)
    assert tuple(resolve_shape(MeshConfig(data=2, context=-1, tensor=2), 16).values()) == (2, 1, 1, 4, 1, 2)
    with pytest.raises(MeshError, match="8 devices cannot"):
        resolve_shape(MeshConfig(data=-1, fsdp=3, tensor=1), 8)
    with pytest.raises(MeshError, match="needs 6 devices but 8"):
        resolve_shape(MeshConfig(data=3, fsdp=2, tensor=1), 8)


def recipe(name):
    """The recipe's config and its parameter count, from shapes alone."""
    import jax
    from flax import nnx
    from podtrain.models import build_model

    cfg = resolve_auto(load_config(CONFIGS / name), "cpu")
    model = nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0)))
    return cfg, sum(x.size for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize(
    "name,reference",
    [
        ("llama_7b.yaml", 6_738_415_616),  # Llama-2-7B
        ("sft_qwen3_0.6b.yaml", 596_049_920),  # Qwen3-0.6B
        ("mhc_3b.yaml", 3_036_658_098),  # Llama's 3B shape with 27 x 2 stream mixers
        ("hrm_sudoku.yaml", 27_275_266 + 512),  # the papers' counts, and the puzzle embedding they count apart
        ("trm_sudoku.yaml", 5_028_866 + 512),
        ("trm_sudoku_pod.yaml", 5_028_866 + 512),
    ],
)
def test_recipe_has_its_reference_size(name, reference):
    assert recipe(name)[1] == reference


def test_recipes_keep_their_setup():
    llama, mhc, trm, pod = (
        load_config(CONFIGS / f) for f in ("llama_7b.yaml", "mhc_3b.yaml", "trm_sudoku.yaml", "trm_sudoku_pod.yaml")
    )
    assert (llama.mesh.data, llama.mesh.fsdp, llama.mesh.tensor) == (2, 4, 2)  # v4-32: 16 chips, one JAX device each
    assert (mhc.model.vocab_size, mhc.train.batch_size, mhc.model.streams) == (49152, 32, 4)
    assert (mhc.mesh.data, mhc.mesh.fsdp, mhc.mesh.tensor) == (1, 8, 1)
    assert load_config(CONFIGS / "mhc_tiny.yaml").model.name == "mhc"
    assert (trm.train.batch_size, trm.train.ema, trm.model.mlp_t) == (768, 0.999, True)
    assert (pod.train.batch_size, pod.mesh.data, pod.model) == (6144, -1, trm.model)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "configs/llama_7b.yaml", "--target", "v5e-1", "mesh.data=1", "mesh.fsdp=1"],
        ["plan", "configs/llama_7b.yaml", "mesh.data=1", "--target", "v5e-1", "mesh.fsdp=1"],
        ["plan", "--target", "v5e-1", "configs/llama_7b.yaml", "mesh.data=1", "mesh.fsdp=1"],
    ],
)
def test_overrides_may_follow_flags(argv):
    args = _parse(argv)
    assert args.config == "configs/llama_7b.yaml" and args.target == "v5e-1"
    assert args.overrides == ["mesh.data=1", "mesh.fsdp=1"]


def test_overrides_after_flags_for_train_doctor_and_convert():
    args = _parse(["train", "--batch-size", "32", "train.steps=5", "--mesh-tp", "2", "train.lr=0.01"])
    assert args.flags == {"--batch-size": "32", "--mesh-tp": "2"} and args.overrides == [
        "train.steps=5",
        "train.lr=0.01",
    ]
    assert _parse(["doctor", "configs/tiny.yaml", "mesh.data=2"]).overrides == ["mesh.data=2"]
    args = _parse(["convert", "--from-hf", "SRC", "RUN", "--dtype", "float32", "train.seq_len=64"])
    assert args.from_hf == ["SRC", "RUN"] and args.overrides == ["train.seq_len=64"]
    with pytest.raises(SystemExit) as exit_info:  # a command without overrides refuses them, as before
        _parse(["generate", "runs/x", "--greedy", "train.steps=3"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("source", ["command line", "yaml"])
def test_values_are_read_as_typed(source, tmp_path):
    """`off`, `on`, `yes` and `no` stay words for a key that takes a word, and are booleans for a
    boolean key; `true`/`false` given to a word key are refused, naming it."""
    values = {"compile_cache": "off", "data.tokenizer": "yes", "checkpoint.async_save": "off"}
    if source == "yaml":
        path = tmp_path / "c.yaml"
        path.write_text("compile_cache: off\ndata:\n  tokenizer: yes\ncheckpoint:\n  async_save: off\n")
        cfg = load_config(path)
    else:
        cfg = load_config(None, [f"{k}={v}" for k, v in values.items()])
    assert cfg.compile_cache == "off" and cfg.data.tokenizer == "yes" and cfg.checkpoint.async_save is False
    assert load_config(None, ["checkpoint.async_save=on"]).checkpoint.async_save is True
    with pytest.raises(ConfigError, match="`compile_cache` in the overrides is the boolean false; it takes a word"):
        load_config(None, ["compile_cache=false"])
    with pytest.raises(ConfigError, match="`model.remat` .* is the boolean true; it takes one of: none, dots, full"):
        load_config(None, ["model.remat=true"])


def test_compile_cache_off_sets_no_cache(monkeypatch, tmp_path):
    import jax
    from podtrain.runtime import use_compile_cache

    monkeypatch.chdir(tmp_path)
    before = jax.config.jax_compilation_cache_dir
    use_compile_cache(load_config(None, ["compile_cache=off"]).compile_cache)
    assert jax.config.jax_compilation_cache_dir == before and not any(tmp_path.iterdir())
