"""Every numeric key is checked against its valid range when the config loads, before any device,
data or compile; a value of the wrong structure names its key. (tests/test_docs.py checks that
docs/configuration.md shows the same ranges.)"""

import pytest
from podtrain.cli import main
from podtrain.config.keys import Range, leaves, ranges
from podtrain.program.load import default_config, load_config
from podtrain.train.hooks import divergence_hint

from helpers import FAMILIES


@pytest.mark.parametrize(
    "override,valid",
    [
        ("train.lr=-1", "> 0"),  # open lower bound
        ("train.lr=nan", "> 0"),  # finite
        ("train.lr=inf", "> 0"),
        ("model.rope_theta=0", "> 0"),
        ("train.beta2=1.5", "[0, 1)"),  # closed below, open above
        ("train.beta1=1", "[0, 1)"),
        ("train.warmup_steps=-5", ">= 0"),  # closed lower bound
        ("train.grad_clip=-1", ">= 0"),
        ("train.min_lr_ratio=1.01", "[0, 1]"),  # closed interval
        ("data.val_fraction=0", "(0, 1)"),  # open interval
        ("mesh.fsdp=0", "-1 or >= 1"),
        ("model.name=trm model.halt_exploration_prob=-0.1", "[0, 1]"),  # a family's key
        ("model.name=mhc model.alpha_init=nan", "finite"),
    ],
)
def test_out_of_range_exits_2_naming_key_and_range(override, valid, tmp_path, capsys, monkeypatch):
    """Rejected while loading: nothing is started (runtime.start would fail the test)."""
    import podtrain.train.loop as loop

    monkeypatch.setattr(loop.runtime, "start", lambda cfg: pytest.fail("the runtime started"))
    args = override.split()
    assert main(["train", *args, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    key = args[-1].split("=")[0]
    assert f"Config key `{key}` is" in err and f"valid values: {valid}, finite" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text,message",
    [
        ("model: [1, 2]", "`model` in {path} must be a mapping of keys (like `model: {{key: value}}`), not `[1, 2]`"),
        ("train: 5", "`train` in {path} must be a mapping of keys"),
        (
            "train: {lr: {a: 1}}",
            "Config key `train.lr` in {path} must be a single value (a number, string or boolean), not `{{'a': 1}}`",
        ),
        ("seed: [1]", "Config key `seed` in {path} must be a single value"),
        ("stages: {microbatches: 4}", "Unknown config section `stages` (as in `stages.microbatches`) in {path}"),
    ],
)
def test_wrong_structure_names_the_key(text, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    assert main(["train", str(path)]) == 2
    assert message.format(path=path) in capsys.readouterr().err


def test_a_key_of_a_section_that_does_not_exist_lists_the_sections(capsys):
    assert main(["train", "foo.bar=1"]) == 2
    err = capsys.readouterr().err
    assert "Unknown config section `foo` (as in `foo.bar`) in the overrides; the sections are " in err
    assert (
        "checkpoint, context, data, distributed, eval, log, mesh, model, pipeline, train." in err
        and "single value" not in err
    )


def test_range_bounds():
    assert (
        0 not in Range("> 0")
        and 1e-12 in Range("> 0")
        and float("nan") not in Range("> 0")
        and float("inf") not in Range(">= 1")
    )
    assert 0 in Range("[0, 1)") and 1 not in Range("[0, 1)") and 1 in Range("[0, 1]") and 0 not in Range("(0, 1)")
    assert -1 in Range("-1 or >= 1") and 0 not in Range("-1 or >= 1") and -1 not in Range(">= 1")
    assert True not in Range("finite") and -3.5 in Range("finite")
    assert "auto" in Range("auto or >= 1") and 2 in Range("auto or >= 1") and 0 not in Range("auto or >= 1")
    assert "auto" not in Range(">= 1") and "other" not in Range("auto or >= 1")


def test_every_numeric_key_of_every_family_has_a_range():
    for name in FAMILIES:
        cfg = default_config(name)
        ranged = {key for key, _, _ in ranges(cfg)}
        numeric = {
            key for key, _, value in leaves(cfg) if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        assert numeric <= ranged, (name, numeric - ranged)
        assert all(str(valid).startswith("auto or ") for key, valid, _ in ranges(cfg) if key not in numeric), name
        assert all(value in valid for _, valid, value in ranges(cfg)), name  # the defaults are valid


def test_divergence_names_the_likely_cause_and_only_a_real_checkpoint():
    cfg = load_config(None, ["train.lr=1"])
    hint = divergence_hint(cfg, None)
    assert (
        "train.lr=1 is 500x this model's default (0.002): lower it" in hint
        and "No checkpoint had been written yet" in hint
    )
    assert "short warmup" in divergence_hint(load_config(None, ["train.warmup_steps=0"]), 4)
    assert "The checkpoint of step 4 in runs/default/checkpoints is intact" in divergence_hint(load_config(None), 4)
