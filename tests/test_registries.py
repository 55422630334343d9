"""Each kind of name (model families, Hugging Face model types, mesh axes, the entries a config
key names) is listed once, in its registry; the config docs, the errors and the plans take it from
there. Adding a name to a registry shows up in every place derived from it."""

import ast
import dataclasses
import functools
import subprocess
import sys
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.axes import AXES, DCN_AXES, MESH_AXIS_ALIASES, PLAIN_AXES
from podtrain.config.keys import same_key
from podtrain.config.parallel import MeshConfig
from podtrain.config.schema import ModelConfig
from podtrain.data.registry import SOURCES
from podtrain.errors import ConfigError
from podtrain.interop.hf import families as hf_families
from podtrain.interop.hf.config_json import ROPE_SCALINGS
from podtrain.interop.hf.families import FAMILIES, family_of
from podtrain.models import MODELS, layers, llama, ops
from podtrain.models.attention import Attention, context, kernels
from podtrain.models.attention.cores import CORES
from podtrain.models.attention.xla import visible
from podtrain.models.llama_config import LlamaConfig
from podtrain.models.rope import rope_tables
from podtrain.planning import gpus, targets
from podtrain.planning.report import sweep_table
from podtrain.program import checks, optim, prepare, sinks
from podtrain.program.checks import changed
from podtrain.program.load import default_config, load_config, mesh_from_env
from podtrain.program.tasks.language import FORMATS, LanguageTask
from podtrain.program.tasks.puzzles import PuzzleTask
from podtrain.program.tasks.registry import TASKS, families_of, task_of
from podtrain.runtime.chips import CHIPS
from podtrain.runtime.mesh import build_mesh
from podtrain.tools import config_docs
from podtrain.train import metrics


@dataclasses.dataclass
class Gpt2Config(LlamaConfig):
    name: str = same_key(ModelConfig, "name", "gpt2")


@pytest.fixture
def gpt2(monkeypatch):
    """MODELS with one more language family, named by its config, whose stack is `n_blocks` long."""
    family = dataclasses.replace(llama.FAMILY, config=Gpt2Config, stacks=("n_blocks",))
    monkeypatch.setitem(MODELS, family.name, family)
    return family


def test_a_new_family_reaches_the_docs_the_pipeline_check_and_the_unroll(gpt2):
    assert gpt2.name == "gpt2" == default_config("gpt2").model.name  # its name written once, in its config
    assert all(MODELS[name].config().name == name for name in MODELS)
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
    cfg = changed(default_config(), {"model.n_layers": 2, "model.n_heads": 8, "model.n_kv_heads": 8})
    assert prepare.unrolled(cfg).model.scan_unroll == 8


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
    assert checks.switches()["model.attention"] == ("auto", *CORES)
    assert all(set(core.context) <= set(context.STRATEGIES) for core in CORES.values())
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


# Each config key that names a registry's entries: (key, its registry, a new entry's name, its record)
SWITCHES = [
    ("train.optimizer", optim.OPTIMIZERS, "lion", optim.adamw),
    ("model.remat", layers.REMAT_POLICIES, "offload", None),
    ("model.matmul_precision", ops.PRECISIONS, "fp4", ops.PRECISIONS["fp8"]),
    ("model.attention", CORES, "flash", dataclasses.replace(CORES["xla"], name="flash")),
    ("context.strategy", context.STRATEGIES, "ulysses", context.STRATEGIES["all_gather"]),
    ("log.to", sinks.SINKS, "stdout", sinks.SINKS["jsonl"]),
]


@pytest.mark.parametrize("key, registry, name, record", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_an_entry_added_to_a_registry_is_a_choice_an_error_and_a_docs_value(key, registry, name, record, monkeypatch):
    """A name added to a switch's registry is a value the checks take, a choice that the error for an
    unknown name (one paragraph) and for a boolean name, and a valid value on the configuration page."""

    def given(word: str) -> str:
        return f"{key}=[{word}]" if key == "log.to" else f"{key}={word}"

    with pytest.raises(ConfigError, match=f"`{key}` (is|has) '{name}'; choose one of: "):
        load_config(None, [given(name)])
    monkeypatch.setitem(registry, name, record)
    value = functools.reduce(getattr, key.split("."), load_config(None, [given(name)]))
    assert value == ([name] if key == "log.to" else name)
    choices = ", ".join(checks.switches()[key])
    assert choices.endswith(f", {name}")
    with pytest.raises(ConfigError) as unknown:
        load_config(None, [given("nonesuch")])
    assert str(unknown.value) == f"Config key `{key}` {'has' if key == 'log.to' else 'is'} 'nonesuch'; " + (
        f"choose one of: {choices}."
    )
    with pytest.raises(ConfigError, match=f"it takes one of: {choices} \\("):
        load_config(None, [f"{key}=true"])
    row = next(line for line in config_docs.configuration_page().splitlines() if line.startswith(f"| `{key}` |"))
    assert f"`{name}`" in row.split(" | ")[3]


def test_the_registries_dispatch(monkeypatch, tmp_path):
    """What a switch names is what runs: the optimizer's builder, the attention core's `run`, the sink
    opened for log.to."""
    monkeypatch.setitem(optim.OPTIMIZERS, "lion", lambda t, mask: ("lion", t.beta1, mask))
    t = load_config(None, ["train.optimizer=lion"]).train
    assert optim.main_optimizer(t, {"w": True}) == ("lion", t.beta1, {"w": True})

    calls = []

    def run(q, k, v, **how):
        calls.append(how)
        return CORES["xla"].run(q, k, v, **how)

    monkeypatch.setitem(CORES, "flash", dataclasses.replace(CORES["xla"], name="flash", run=run))
    attn = Attention(16, 2, 1, std=0.1, out_std=0.1, dtype=jnp.float32, implementation="flash", rngs=nnx.Rngs(0))
    assert attn(jnp.ones((1, 4, 16)), rope_tables(4, 8, 10000.0)).shape == (1, 4, 16)
    assert len(calls) == 1 and calls[0]["causal"] and calls[0]["order"] is None

    opened = []
    monkeypatch.setitem(sinks.SINKS, "stdout", sinks.Sink(lambda start: opened.append(start) or sinks.Jsonl(start)))
    metrics.MetricsLog(load_config(None, [f"run_dir={tmp_path}", "log.to=[stdout]"])).close()
    assert [start.step for start in opened] == [0]


def hand_written(source: str, names: dict[str, set[str]]) -> list[str]:
    """The comparisons (==, !=, in, not in) in `source` of an attribute named `names`' key (as in
    `cfg.train.optimizer`) with a string, or strings, among that key's names, as written."""

    def strings(node) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        return set().union(*map(strings, node.elts)) if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else set()

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(
            isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops
        ):
            sides = [node.left, *node.comparators]
            if any(
                isinstance(a, ast.Attribute) and strings(b) & names.get(a.attr, set())
                for a in sides
                for b in sides
                if b is not a
            ):
                found.append(ast.unparse(node))
    return found


def _switch_names() -> dict[str, set[str]]:
    """Each switch's attribute (`optimizer` of train.optimizer) -> its registry's names (not `auto`,
    which the platform resolves)."""
    return {key.rsplit(".", 1)[1]: set(names) - {"auto"} for key, names in checks.switches().items()}


def test_no_registry_name_is_compared_by_hand():
    """No module compares a switch's config value with its registry's names written out: it asks the
    registry's record (what a core takes, whether a precision quantizes, what a sink needs)."""
    found = [
        f"{path}:{text}"
        for path in sorted(Path(checks.__file__).parents[1].rglob("*.py"))
        for text in hand_written(path.read_text(), _switch_names())
    ]
    assert not found, "registry names written by hand: " + "; ".join(found)


def test_a_name_compared_by_hand_is_found():
    planted = """
if cfg.train.optimizer == "adamw" or m.remat in ("full", "dots") or "wandb" in cfg.log.to:
    pass
if cfg.model.attention == "auto" or cfg.model.remat == other or self.core.name != "flash" or x.size == "xla":
    pass
"""
    assert hand_written(planted, _switch_names()) == [
        "cfg.train.optimizer == 'adamw'",
        "m.remat in ('full', 'dots')",
        "'wandb' in cfg.log.to",
    ]


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    return str(refused.value)


def test_a_data_source_added_to_the_registry_is_a_choice_a_check_and_a_docs_row(monkeypatch):
    """A source added to SOURCES is a value of data.source that asks for its data.path, read by the
    task its record names, in the page's choices and its table of sources; an unknown one is
    refused in one paragraph naming the sources."""
    unknown = _refusal(["data.source=web"])
    assert unknown == "Config key `data.source` is 'web'; choose one of: pydoc, text, tokens, sudoku."
    web = dataclasses.replace(SOURCES["tokens"], doc="pages from the web", reads="a folder of crawled pages")
    monkeypatch.setitem(SOURCES, "web", web)
    assert _refusal(["data.source=web"]) == "data.source=web needs data.path=DIR, a folder of crawled pages."
    assert load_config(None, ["data.source=web", "data.path=crawl"]).data.source == "web"
    assert "web" in LanguageTask.data_sources and "web" not in PuzzleTask.data_sources
    assert _refusal(["data.source=news"]).endswith("choose one of: pydoc, text, tokens, sudoku, web.")
    assert " or web (a folder of crawled pages)." in _refusal(["data.path=crawl"])  # pydoc reads none
    page = config_docs.configuration_page()
    assert "| `data.source` | str | `pydoc` | `pydoc`, `text`, `tokens`, `sudoku`, `web` |" in page
    assert "| `web` | `DIR`, a folder of crawled pages | `llama`, `mhc`, `moe` | pages from the web |" in page


def test_a_data_format_added_to_the_registry_is_a_choice_a_check_a_batch_and_a_docs_row(monkeypatch):
    """A format added to FORMATS is a value of data.format, checked against the sources it reads,
    whose rows the language task lays its batches out by, in the page's choices and its table of
    formats; an unknown one is refused in one paragraph naming the formats."""
    assert _refusal(["data.format=code"]) == "Config key `data.format` is 'code'; choose one of: text, chat, pairs."
    code = dataclasses.replace(
        FORMATS["chat"], doc="programs and their tests", holds="programs from a JSONL file or folder", channels=(4,)
    )
    monkeypatch.setitem(FORMATS, "code", code)
    assert _refusal(["data.format=code"]) == (
        "data.format=code reads programs from a JSONL file or folder: set data.source=text and "
        "data.path=FILE_OR_DIR (not data.source=pydoc)."
    )
    cfg = load_config(None, ["data.format=code", "data.source=text"])
    task = LanguageTask(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), data=False)
    assert task.train_batch.shape == (1, cfg.train.batch_size, 4, cfg.train.seq_len + 1)
    assert _refusal(["data.format=prose"]).endswith("choose one of: text, chat, pairs, code.")
    page = config_docs.configuration_page()
    assert "| `data.format` | str | `text` | `text`, `chat`, `pairs`, `code` |" in page
    assert "| `code` | `text` | `lm` | programs and their tests |" in page


def test_an_objective_is_named_by_the_format_it_learns_from(monkeypatch):
    """train.objective's choices are the objectives of the formats: a format that names a new one
    (its losses beside it) makes it a value the checks take and the page lists; an unknown one is
    refused in one paragraph naming the objectives."""
    assert _refusal(["train.objective=grpo"]) == "Config key `train.objective` is 'grpo'; choose one of: lm, dpo."
    monkeypatch.setitem(FORMATS, "prompts", dataclasses.replace(FORMATS["pairs"], objective="grpo"))
    cfg = load_config(None, ["train.objective=grpo", "data.format=prompts", "data.source=text", "data.path=x.jsonl"])
    assert cfg.train.objective == "grpo"
    assert "| `train.objective` | str | `lm` | `lm`, `dpo`, `grpo` |" in config_docs.configuration_page()


def test_a_task_added_to_the_registry_reads_its_sources_and_reaches_the_docs(monkeypatch, gpt2):
    """A task of TASKS is what a family's record and a data source's record name: it reads the
    sources that name it, the page lists it with its families and sources, and a family naming no
    registered task is refused in one paragraph naming the tasks."""
    monkeypatch.setitem(MODELS, "gpt2", dataclasses.replace(gpt2, task="masked"))
    with pytest.raises(ConfigError) as unknown:
        default_config("gpt2")
    assert str(unknown.value) == (
        "model.name=gpt2 trains on the task 'masked', which is not registered; its record (Family.task) must "
        "name one of: language, puzzles."
    )
    masked = type("MaskedTask", (LanguageTask,), {"name": "masked"})
    monkeypatch.setitem(TASKS, "masked", masked)
    monkeypatch.setitem(SOURCES, "spans", dataclasses.replace(SOURCES["text"], task="masked"))
    assert masked.data_sources == ("spans",) and "spans" not in LanguageTask.data_sources
    assert families_of(masked) == ["gpt2"] and task_of(MODELS["gpt2"]) is masked
    assert "; `masked` (`gpt2`) on `spans`." in config_docs.configuration_page()
