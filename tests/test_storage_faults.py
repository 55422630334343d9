"""A bucket under real faults, end to end (make test-integration): the bpe tiny recipe killed and
resumed in GCS, processes that share nothing but the bucket, and requests that fail or drop."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import fsspec
import jax
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.train.metrics import read_metrics
from podtrain.train.run import Run

from compile_flags import TEST_COMPILES
from helpers import CLEAN_ENV, SMALL, run_steps

pytest_plugins = ["buckets"]
pytestmark = pytest.mark.integration

QUIET = ["train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0"]
CONSTANT_LR = ["train.warmup_steps=2", "train.min_lr_ratio=1.0"]  # the schedule does not depend on train.steps


def _podtrain(args, env, cwd, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "podtrain", *args],
        env={**CLEAN_ENV, **env},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def _committed(fs, name: str, run: str) -> list[int]:
    return sorted(int(p.split("/")[-2]) for p in fs.glob(f"{name}/{run}/checkpoints/*/commit_success.txt"))


def _kill_after_a_checkpoint(processes, fs, name, run, at_least=2, timeout=300):
    """SIGKILL the processes once a checkpoint of step `at_least` or later has committed."""
    deadline = time.monotonic() + timeout
    while not [s for s in _committed(fs, name, run) if s >= at_least]:
        assert all(p.poll() is None for p in processes), "\n---\n".join(p.communicate()[0][-3000:] for p in processes)
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for p in processes:
        p.send_signal(signal.SIGKILL)
        p.communicate()


def _prepared(gcs, tmp_path) -> tuple[str, str]:
    """The bpe tiny recipe's data (docs/data.md) in the bucket and on the local disk."""
    for where in (gcs.path, str(tmp_path)):
        tokenizer = f"{where}/pydoc-bpe-tokenizer"
        assert main(["data", "tokenizer", "--input", "pydoc", "--vocab-size", "1024", "--out", tokenizer]) == 0
        prepare = ["data", "prepare", "--input", "pydoc", "--tokenizer", tokenizer, "--val-fraction", "0.2"]
        assert main([*prepare, "--out", f"{where}/pydoc-bpe"]) == 0
    return f"{gcs.path}/pydoc-bpe", str(tmp_path / "pydoc-bpe")


def test_the_bpe_recipe_in_a_bucket_killed_and_resumed_ends_as_a_local_run(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    remote, local = _prepared(gcs, tmp_path)
    recipe = ["configs/bpe_tiny.yaml", *QUIET, *CONSTANT_LR, "train.steps=40", "checkpoint.every=10"]
    recipe[0] = os.path.join(os.path.dirname(__file__), "..", recipe[0])
    job = ["train", *recipe, f"data.path={remote}", f"run_dir={gcs.path}/run"]
    fs = fsspec.filesystem("gs")
    _kill_after_a_checkpoint([_podtrain(job, gcs.env, tmp_path)], fs, gcs.name, "run", at_least=10)
    resumed = _podtrain(job, gcs.env, tmp_path)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0 and re.search(r"resuming from step [1-3]0", output), output[-3000:]
    assert "Traceback" not in output and "WARNING" not in output and "gs:" not in os.listdir(tmp_path)
    uninterrupted = _podtrain(["train", *recipe, f"data.path={local}", f"run_dir={tmp_path}/local"], {}, tmp_path)
    assert uninterrupted.wait(timeout=600) == 0
    remote_losses = {r["step"]: r["loss"] for r in read_metrics(f"{gcs.path}/run") if "loss" in r}
    local_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "local") if "loss" in r}
    assert list(remote_losses) == list(range(1, 41))
    np.testing.assert_allclose([remote_losses[s] for s in local_losses], list(local_losses.values()), atol=1e-5)


def test_processes_that_share_only_the_bucket_resume_on_another_count(gcs, tmp_path, monkeypatch):
    """2 processes x 4 devices, each in an empty folder of its own, data and run in the bucket: killed
    after a checkpoint, resumed by 1 process x 8 devices; the params equal an uninterrupted local run's."""
    monkeypatch.chdir(tmp_path)
    remote, _ = _prepared(gcs, tmp_path)
    job = [*SMALL, *QUIET, *CONSTANT_LR, "data.source=tokens", f"data.path={remote}", "model.vocab_size=1024"]
    run = [*job, "checkpoint.every=2", f"run_dir={gcs.path}/run"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = []
    for i in range(2):
        (folder := tmp_path / f"host{i}").mkdir()
        env = {
            **gcs.env,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {TEST_COMPILES}",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_PROCESS_COUNT": "2",
            "JAX_PROCESS_INDEX": str(i),
        }
        processes.append(_podtrain(["train", *run, "train.steps=400"], env, folder))
    fs = fsspec.filesystem("gs")
    _kill_after_a_checkpoint(processes, fs, gcs.name, "run", at_least=4)
    assert not os.listdir(tmp_path / "host0") and not os.listdir(tmp_path / "host1")  # nothing but the bucket
    latest = _committed(fs, gcs.name, "run")[-1]
    steps = latest + 3
    one = _podtrain(
        ["train", *run, f"train.steps={steps}"], {**gcs.env, "XLA_FLAGS": os.environ["XLA_FLAGS"]}, tmp_path
    )
    output = one.communicate(timeout=600)[0]
    assert one.returncode == 0 and f"resuming from step {latest}" in output and "process 0/1" in output, output[-3000:]
    losses, params = run_steps([*job, f"train.steps={steps}"], n_devices=8, n_steps=steps)
    logged = {r["step"]: r["loss"] for r in read_metrics(f"{gcs.path}/run") if "loss" in r}
    np.testing.assert_allclose([logged[s] for s in range(1, steps + 1)], losses, rtol=0, atol=1e-5)
    _, _, step, restored = Run.at(f"{gcs.path}/run").model()
    assert step == steps
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-5), restored, params)


def test_requests_that_fail_or_drop_are_retried_and_the_run_is_unchanged(gcs, faulty_proxy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = ["train", *SMALL, *QUIET, *CONSTANT_LR, "train.steps=6", "checkpoint.every=2"]
    proxy = faulty_proxy(gcs, fail_every=7, drop_every=11)
    assert main([*job, f"run_dir={gcs.path}/run"]) == 0
    assert proxy.failed > 0 and proxy.dropped > 0, proxy.counts()
    assert main([*job, f"run_dir={tmp_path}/local"]) == 0
    remote = {r["step"]: r["loss"] for r in read_metrics(f"{gcs.path}/run") if "loss" in r}
    local = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "local") if "loss" in r}
    assert remote == pytest.approx(local, abs=1e-6) and list(remote) == list(range(1, 7))
    print(f"through the proxy: {proxy.counts()}")


def test_the_server_dying_during_saves_leaves_only_complete_checkpoints(gcs, tmp_path, monkeypatch):
    """The store is killed while a job saves every step, and comes back 5 s later: the job goes on
    (its requests retried) or stops; rerun, it ends with every loss of an uninterrupted run, and
    every checkpoint the bucket calls complete verifies."""
    monkeypatch.chdir(tmp_path)
    job = ["train", *SMALL, *QUIET, *CONSTANT_LR, "train.steps=16", "checkpoint.every=1", "checkpoint.keep=16"]
    fs = fsspec.filesystem("gs")
    first = _podtrain([*job, f"run_dir={gcs.path}/run"], gcs.env, tmp_path)
    deadline = time.monotonic() + 300
    while not _committed(fs, gcs.name, "run"):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.1)
    gcs.stop()
    time.sleep(5)
    gcs.start()
    output = first.communicate(timeout=600)[0]
    assert "Traceback" not in output, output[-3000:]
    again = _podtrain([*job, f"run_dir={gcs.path}/run"], gcs.env, tmp_path)
    output += again.communicate(timeout=600)[0]
    assert again.returncode == 0, output[-3000:]
    assert main(["checkpoints", f"{gcs.path}/run"]) == 0  # each listed step verifies
    assert main([*job, f"run_dir={tmp_path}/local"]) == 0
    remote = {r["step"]: r["loss"] for r in read_metrics(f"{gcs.path}/run") if "loss" in r}
    local = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "local") if "loss" in r}
    assert remote == pytest.approx(local, abs=1e-5), output[-3000:]  # one device there, eight here
    print(f"first attempt: exit {first.returncode}; committed steps {_committed(fs, gcs.name, 'run')}")
