"""The default job end to end through the CLI: metrics, checkpoint, resume, generate, plot."""

import shutil

import jax
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.config.parallel import MeshConfig
from podtrain.data.tokenizer import ByteTokenizer
from podtrain.program.load import load_config
from podtrain.program.sampler import Sampling, complete
from podtrain.program.state import model_fns
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.metrics import read_metrics


def expected_sample(checkpoints, prompt, n, seed):
    """The text `n` new tokens sampled at temperature 0.8 from the latest checkpoint in `checkpoints`."""
    cfg = load_config(checkpoints.parent / "config.yaml")
    fns = model_fns(cfg, build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]))
    checkpointer = Checkpointer(checkpoints)
    params = checkpointer.restore({"params": fns.abstract_params})["params"]
    checkpointer.close()
    text = complete(
        fns, params, ByteTokenizer(), [prompt], n, Sampling(0.8), seeds=[seed], max_len=cfg.model.max_seq_len
    )[0]
    assert text  # n new bytes decode to at least one character
    return text


def test_train_resume_generate_plot(tmp_path, small_overrides, capsys):
    run = tmp_path / "run"
    common = small_overrides + [
        f"run_dir={run}",
        "train.log_every=2",
        "train.eval_every=3",
        "checkpoint.every=3",
        "train.eval_batches=2",
    ]
    assert main(["train", *common, "train.steps=6"]) == 0
    records = read_metrics(run)
    train_lines = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_lines] == [2, 4, 6]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time", "mfu"} <= set(train_lines[0])
    assert train_lines[0]["mfu"] is None  # CPU peak FLOP/s is unknown
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    assert (run / "config.yaml").exists() and list(run.glob("events.out.tfevents.*"))
    assert (
        "[podtrain] cpu: 8 x cpu, process 0/1, mesh data=8 stage=1 fsdp=1 context=1 expert=1 tensor=1"
        in capsys.readouterr().out
    )

    assert main(["train", *common, "train.steps=8"]) == 0
    assert "resuming from step 6" in capsys.readouterr().out
    assert read_metrics(run)[-1]["step"] == 8

    # generate reads the run directory it is given, also once moved away from the run_dir in its config
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    assert main(["generate", str(moved), "--prompt", "def ", "--max-new-tokens", "12", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and printed.endswith("\n")
    assert printed[len("def ") : -1] == expected_sample(moved / "checkpoints", "def ", 12, seed=3)
    run = moved

    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("precision", ["compute", "fp8"])
def test_resume_continues_exactly(tmp_path, small_overrides, precision):
    """A run stopped after its step-3 checkpoint and resumed logs the losses of an uninterrupted run,
    and its metrics.jsonl, which already held steps 4-6 from before the stop, has each step once.
    fp8's scales are computed from the tensors of each step: nothing of them is lost by stopping."""

    def train(run):
        main(
            [
                "train",
                *small_overrides,
                f"model.matmul_precision={precision}",
                f"run_dir={run}",
                "train.log_every=1",
                "checkpoint.every=3",
                "train.steps=6",
                "train.eval_every=100",
                "train.eval_batches=1",
            ]
        )
        return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]

    straight = train(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "6")  # as if stopped before the step-6 save
    resumed = train(tmp_path / "b")
    assert [s for s, _ in resumed] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([loss for _, loss in resumed], [loss for _, loss in straight], rtol=0, atol=1e-6)
    assert [r["step"] for r in read_metrics(tmp_path / "b") if "val_loss" in r] == [6]


def test_every_zero_means_only_after_the_last_step(tmp_path, small_overrides):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *small_overrides,
                f"run_dir={run}",
                "train.steps=4",
                "train.log_every=1",
                "train.eval_every=0",
                "checkpoint.every=0",
                "train.eval_batches=1",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    assert [r["step"] for r in read_metrics(run) if "val_loss" in r] == [4]


def test_config_is_written_resolved(tmp_path, small_overrides):
    import yaml

    run = tmp_path / "run"
    main(
        [
            "train",
            *[o for o in small_overrides if "compute_dtype" not in o],
            f"run_dir={run}",
            "train.steps=1",
            "train.eval_batches=1",
            "train.ema=0.9",
        ]
    )
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["ema"] == 0.9 and (run / "checkpoints" / "1" / "ema").is_dir()
    assert saved["model"]["compute_dtype"] == "float32" and saved["model"]["attention"] == "xla"
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1]


@pytest.mark.integration
def test_a_second_run_reads_its_programs_from_the_compile_cache(tmp_path, small_overrides):
    """In fresh processes (JAX fixes its cache folder at the first compile): the first run fills
    compile_cache=DIR, and a second one reads its train step from there (JAX logs each hit with
    JAX_LOG_COMPILES). Which small programs pass the compile-time threshold varies between runs,
    so the second may add entries, never lose any."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    args = [
        *small_overrides,
        "train.steps=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "checkpoint.every=0",
        f"compile_cache={cache}",
    ]

    def run(name):
        done = subprocess.run(
            [sys.executable, "-m", "podtrain", "train", *args, f"run_dir={tmp_path / name}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "JAX_LOG_COMPILES": "1"},
        )
        return set(p.name for p in cache.iterdir()), done.stderr

    first, _ = run("a")
    second, log = run("b")
    assert first and first <= second
    assert "Persistent compilation cache hit for 'jit_train_step'" in log
