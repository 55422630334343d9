"""Each kind of name (model families, Hugging Face model types, mesh axes) is listed once, in its
registry; the config docs, the errors and the plans take it from there. Adding a name to a registry
shows up in every place derived from it."""

import dataclasses
import subprocess
import sys
import typing

import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.axes import AXES, DCN_AXES, MESH_AXIS_ALIASES, PLAIN_AXES
from podtrain.config.parallel import MeshConfig
from podtrain.config.schema import ModelConfig
from podtrain.errors import ConfigError
from podtrain.interop.hf import families as hf_families
from podtrain.interop.hf.config_json import ROPE_SCALINGS
from podtrain.interop.hf.families import FAMILIES, family_of
from podtrain.models import MODELS, llama
from podtrain.models.attention import kernels
from podtrain.models.attention.cores import CORES
from podtrain.models.attention.xla import visible
from podtrain.models.llama_config import LlamaConfig
from podtrain.planning import fit, gpus, targets
from podtrain.planning.report import sweep_table
from podtrain.program import checks
from podtrain.program.load import default_config, load_config, mesh_from_env
from podtrain.program.tasks.registry import TASKS, task_of
from podtrain.runtime.chips import CHIPS
from podtrain.tools import config_docs


@pytest.fixture
def gpt2(monkeypatch):
    """MODELS with one more language family, whose stack is `n_blocks` long."""
    family = dataclasses.replace(llama.FAMILY, name="gpt2", stacks=("n_blocks",))
    monkeypatch.setitem(MODELS, "gpt2", family)
    return family


def test_a_new_family_reaches_the_docs_the_pipeline_check_and_the_unroll(gpt2):
    assert "`gpt2`" in config_docs._families_reading("text")
    assert "`gpt2`" not in config_docs._families_reading("sudoku")
    cfg = default_config("trm")  # its layers run inside a recurrence
    cfg.mesh.stage = 2
    with pytest.raises(
        ConfigError, match="llama or mhc or moe or gpt2 models .*; this is model.name=trm \\(its layers run inside"
    ):
        checks._check_pipeline(cfg)


def test_unrolling_takes_the_familys_longest_stack(monkeypatch):
    monkeypatch.setitem(MODELS, "llama", dataclasses.replace(llama.FAMILY, stacks=("n_layers", "n_heads")))
    cfg = fit.changed(default_config(), {"model.n_layers": 2, "model.n_heads": 8, "model.n_kv_heads": 8})
    assert fit.unrolled(cfg).model.scan_unroll == 8


def test_the_docs_name_every_family_by_its_task():
    page = config_docs.configuration_page()
    for name, family in MODELS.items():
        assert f"`{name}`" in page.split("## Top-level keys")[0], name
        assert task_of(family).data_sources


def test_hf_types_are_the_families_table(monkeypatch):
    """A model_type added to the families table is a `model.hf_type` its podtrain family takes, a
    choice in the docs and a name in the import's error."""
    assert {f.model_name for f in FAMILIES.values()} <= set(MODELS)
    with pytest.raises(ConfigError, match="model.hf_type='falcon' .* choose one of: llama, mistral, .*, phi3\\."):
        load_config(None, ["model.hf_type=falcon"])
    extra = dataclasses.replace(FAMILIES["llama"], model_type="falcon", known_as="Falcon")
    monkeypatch.setitem(hf_families.FAMILIES, "falcon", extra)
    assert load_config(None, ["model.hf_type=falcon"]).model.hf_type == "falcon"
    with pytest.raises(ConfigError, match="model.hf_type='falcon' .* choose one of: mixtral, qwen3_moe, deepseek_v3"):
        load_config(None, ["model.name=moe", "model.hf_type=falcon"])
    assert (
        "| `model.hf_type` | str | `llama` | `llama`, `mistral`, `qwen2`, `qwen3`, `gemma2`, `gemma3_text`, `phi3`, "
        "`falcon` |" in config_docs.configuration_page()
    )
    with pytest.raises(ConfigError, match="model_type llama, .*falcon \\(Llama, .*Phi-3, Falcon\\)"):
        family_of({"model_type": "gpt_neox"}, "here")


def test_an_axis_added_to_the_table_is_a_mesh_key_a_docs_row_and_a_plan_column():
    """A new entry of axes.MESH_AXES (here before anything reads it, in a fresh process) is a
    mesh key with its slices' key, a row of the configuration page and a column of the plan's sweep."""
    code = """
import pathlib, sys, types
import podtrain
path = pathlib.Path(podtrain.__file__).with_name("axes.py")
row = "MESH_AXES += (Axis('pod', 'devices that split pods', 'slices of pods'),)\\n"
source = path.read_text().replace("\\nAXES = tuple", "\\n" + row + "AXES = tuple", 1)
sys.modules["podtrain.axes"] = module = types.ModuleType("podtrain.axes")
module.__file__ = str(path)
exec(compile(source, str(path), "exec"), module.__dict__)
from podtrain.program.load import load_config
from podtrain.planning.report import sweep_table
from podtrain.tools.config_docs import configuration_page
cfg, page = load_config(None, ["mesh.pod=2", "mesh.dcn_pod=3"]), configuration_page()
shape = {**{f"mesh.{a}": 1 for a in module.AXES}, "model.remat": "none"}
header = sweep_table([(shape, "cannot. no")]).splitlines()[0].split()
print(cfg.mesh.pod, cfg.mesh.dcn_pod, "| `mesh.pod` | int | 1 |" in page, "`mesh.dcn_pod`" in page, header[6])
"""
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert said.split() == ["2", "3", "True", "True", "pod"]


def test_mesh_keys_are_the_axes_then_their_slices():
    keys = [f.name for f in dataclasses.fields(MeshConfig)]
    assert keys == [*AXES, *(f"dcn_{a}" for a in DCN_AXES)]
    assert set(MESH_AXIS_ALIASES.values()) <= set(AXES) and set(PLAIN_AXES) <= set(AXES)


def test_an_alias_reaches_the_environment_and_the_docs(monkeypatch):
    monkeypatch.setitem(MESH_AXIS_ALIASES, "pp", "stage")
    assert mesh_from_env({"TPU_MESH_CONFIG": "2,4", "TPU_AXIS_NAMES": "pp,data"}) == ["mesh.stage=2", "mesh.data=4"]
    assert "`pp` for `stage`" in config_docs._axis_aliases()
    with pytest.raises(ConfigError, match="pp for stage"):
        mesh_from_env({"TPU_MESH_CONFIG": "2", "TPU_AXIS_NAMES": "dp"})


def test_the_sweep_table_has_a_column_per_axis():
    mesh = {f"mesh.{a}": 1 for a in AXES} | {f"mesh.dcn_{a}": 2 for a in DCN_AXES}
    header = sweep_table([({**mesh, "model.remat": "none"}, "cannot. no")]).splitlines()[0].split()
    assert header[: len(AXES) + len(DCN_AXES)] == [*AXES, *(f"dcn_{a}" for a in DCN_AXES)]


def test_rope_scalings_read_and_written_are_the_configs_choices():
    choices = typing.get_args(typing.get_type_hints(LlamaConfig)["rope_scaling"])
    assert choices == ("none", *ROPE_SCALINGS) == tuple(llama.ROPE_SCALINGS)  # read, written and computed
    for kind, keys in ROPE_SCALINGS.items():
        assert set(keys) <= set(LlamaConfig.__dataclass_fields__), kind


def test_targets_are_the_chips_table(monkeypatch):
    """Each GPU chip has a card to compile for; a TPU generation added to CHIPS is a target at once."""
    assert set(gpus.CARDS) == {name for name, chip in CHIPS.items() if not chip.tpu}
    monkeypatch.setitem(CHIPS, "v7", dataclasses.replace(CHIPS["v6e"], name="TPU v7"))
    # libtpu stood in for: the devices of `cores` cores
    described = lambda name, generation, cores, slices: targets.Target(  # noqa: E731
        name, "tpu", CHIPS[generation], list(range(cores)), slices
    )
    monkeypatch.setattr(targets, "tpu_target", described)
    with pytest.raises(ConfigError, match="v6e-8, v7-8, .*h100, h200, a100"):
        targets.target("v9-8")
    found = targets.target("2xv7-16")
    assert (found.chip.name, len(found.devices), found.slices) == ("TPU v7", 16, 2)


def test_models_import_nothing_of_training():
    """A model family is its module and config alone: importing them loads neither the training
    code nor its data libraries; each record names a registered task."""
    code = "import sys, podtrain.models; print([m for m in sys.modules if m.startswith(('podtrain.train', 'grain'))])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    assert all(record.task in TASKS for record in MODELS.values())


def test_attention_cores_are_listed_once():
    """model.attention's choices are the cores' records plus auto, and the configuration page's
    table shows each record."""
    choices = typing.get_args(typing.get_type_hints(ModelConfig)["attention"])
    assert set(choices) == {"auto", *CORES}
    page = config_docs.configuration_page()
    assert all(f"| `{name}` |" in page for name in CORES)


@pytest.mark.parametrize("causal", [True, False])
def test_every_core_sees_by_one_rule(causal):
    """The splash kernel's static mask and the xla path's O(T) one are the same rule (`sees`),
    causal or not, a window on either side of a non-causal query."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    t, window = 16, 5
    order = np.random.default_rng(0).permutation(t)  # queries in any static order, as under context
    splash = masks._ComputableMask.__getitem__(kernels._sight(masks)((t, t), order, causal, window), np.s_[:, :])
    sight = ((jnp.asarray(order), jnp.arange(t)), None, window)
    xla_mask = np.asarray(visible(sight, 0, t, t, causal))[0, 0, :, 0, :]
    np.testing.assert_array_equal(splash, xla_mask)
    assert xla_mask.sum(1).max() == (window if causal else 2 * window - 1)
