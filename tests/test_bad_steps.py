"""A step whose loss or gradient is not finite is skipped, never reaches the weights or a
checkpoint, and train.max_bad_steps of them in a row stop the run."""

import jax
import jax.numpy as jnp
import numpy as np
from podtrain.cli import main
from podtrain.config.parallel import MeshConfig
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.program.tasks import language as lm
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.metrics import read_metrics

from helpers import trainer


def poisoned_loss(model, carry, tokens, key):
    """The next-token loss made NaN: the test's switch for a step that blew up."""
    loss, aux = lm.next_token_loss(model, carry, tokens, key)
    return loss * jnp.nan, aux


def test_a_non_finite_step_leaves_the_state_unchanged_but_the_step(small_overrides, monkeypatch):
    state, step, batches = trainer([*small_overrides, "mesh.data=2"], n_devices=2)
    state, metrics = step(state, batches[0])
    assert not bool(metrics["skipped"])
    before = jax.device_get({k: v for k, v in state.items() if k != "step"})
    monkeypatch.setattr(lm.LanguageTask, "loss_fn", staticmethod(poisoned_loss))
    state, metrics = jax.device_get(trainer([*small_overrides, "mesh.data=2"], n_devices=2)[1](state, batches[1]))
    assert bool(metrics["skipped"]) and np.isnan(metrics["loss"]) and int(state["step"]) == 2
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b), {k: v for k, v in state.items() if k != "step"}, before
    )


def test_max_bad_steps_in_a_row_stop_with_only_finite_checkpoints(small_overrides, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lm.LanguageTask, "loss_fn", staticmethod(poisoned_loss))
    run = tmp_path / "run"
    args = [
        *small_overrides,
        f"run_dir={run}",
        "train.steps=10",
        "train.log_every=1",
        "checkpoint.every=1",
        "checkpoint.async_save=false",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.max_bad_steps=2",
    ]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "not finite at steps 1 to 2 (train.max_bad_steps=2 in a row); those updates were skipped" in err
    assert "The checkpoint of step 2" in err
    assert [r["skipped"] for r in read_metrics(run) if "loss" in r] == [1.0, 1.0]
    cfg = load_config(None, args)
    fns = model_fns(cfg, build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
    checkpointer = Checkpointer(run / "checkpoints")
    saved = checkpointer.restore({"params": fns.abstract_params})["params"]
    checkpointer.close()
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b),
        jax.device_get(saved),
        jax.device_get(fns.init(jax.random.key(cfg.seed))),
    )
