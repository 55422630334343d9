"""Each user error: exit code 2, a message naming the problem, no traceback."""

import os
import subprocess
import sys

import pytest


def run_cli(*args, cwd=None):
    env = {**os.environ, "JAX_PLATFORMS": ""}  # the tests' eight devices and compiles (conftest.py), any platform
    return subprocess.run(
        [sys.executable, "-m", "podtrain", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def write(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


CASES = {
    "malformed_yaml": (lambda d: [write(d, "train:\n  steps: [1, 2\n")], "not valid YAML"),
    "unknown_key": (lambda d: ["model.d_modle=64"], "Did you mean `model.d_model`"),
    "wrong_type": (lambda d: ["train.batch_size=eight"], "train.batch_size"),
    "missing_config": (lambda d: [str(d / "nope.yaml")], "does not exist"),
    "missing_data": (
        lambda d: ["data.source=text", f"data.path={d / 'none.txt'}", f"run_dir={d / 'run'}"],
        "does not exist",
    ),
    "mesh_mismatch": (
        lambda d: ["device_type=cpu", "mesh.data=3", f"run_dir={d / 'run'}"],
        "needs 3 devices but 8 are available",
    ),
    "batch_not_divisible": (
        lambda d: ["device_type=cpu", "train.batch_size=12", f"run_dir={d / 'run'}"],
        "multiple of 8",
    ),
    "forced_device_absent": (lambda d: ["device_type=tpu", f"run_dir={d / 'run'}"], "device_type=tpu was requested"),
}


@pytest.mark.parametrize("case", CASES)
def test_user_error_exits_2_without_traceback(case, tmp_path):
    make_args, message = CASES[case]
    result = run_cli("train", *make_args(tmp_path))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.integration
def test_diverged_loss_exits_2_and_keeps_checkpoints(tmp_path):
    """...and `checkpoints` and `generate` over the run it leaves print none of libtpu's warnings."""
    from helpers import NOISE, SMALL

    run = tmp_path / "run"
    result = run_cli(
        "train",
        *SMALL,
        f"run_dir={run}",
        "train.lr=1e12",
        "train.steps=6",
        "train.warmup_steps=1",
        "train.log_every=1",
        "checkpoint.every=1",
        "train.eval_every=100",
        "train.eval_batches=1",
    )
    assert result.returncode == 2, result.stderr
    assert "was not finite at steps 2 to 4" in result.stderr and "Traceback" not in result.stderr
    assert "Likely cause: train.lr=1e+12 is" in result.stderr  # far above the default
    assert (run / "checkpoints" / "4").is_dir() and (run / "metrics.jsonl").read_text().count("\n") >= 1

    # The other commands over the run it left, as quiet as train on a machine without a TPU.
    listing = run_cli("checkpoints", str(run))
    sampled = run_cli("generate", str(run), "--max-new-tokens", "4")
    assert listing.returncode == sampled.returncode == 0 and "verified" in listing.stdout, listing.stderr
    for done in (result, listing, sampled):
        for noise in NOISE:
            assert noise not in done.stdout + done.stderr, done.stderr[-2000:]
