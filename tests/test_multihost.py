"""Real processes on 127.0.0.1: several processes train exactly like one, fail fast, and refuse
half-set environments."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from podtrain.config.parallel import MeshConfig
from podtrain.data.prepare import prepare
from podtrain.data.sources import Corpus, pydoc_documents
from podtrain.data.tokenizer import ByteTokenizer, fit_bpe, load_tokenizer
from podtrain.errors import DistributedError
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.sampler import Sampling, complete
from podtrain.runtime.distributed import from_environment
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.metrics import read_metrics

from helpers import CLEAN_ENV, SMALL, podtrain, run_steps

TESTS = Path(__file__).parent


# One mesh over both processes: fsdp spans them (its all-gathers and reduce-scatters cross them)
# and splits the batch with data. Or each process a slice: fsdp and tensor inside each, data
# across (mesh.dcn_data=2), or each a pipeline stage (mesh.dcn_stage=2).
# test_resume_on_another_process_count splits the batch by data alone.
ONE_MESH = ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
TWO_SLICES = ["mesh.dcn_data=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
TWO_STAGES = ["mesh.dcn_stage=2", "mesh.data=1", "mesh.fsdp=4"]  # a pipeline stage per process


@pytest.mark.parametrize(
    "nproc,per_proc,mesh,status",
    [
        pytest.param(
            2, 4, ONE_MESH, "mesh data=1 stage=1 fsdp=4 context=1 expert=1 tensor=2", marks=pytest.mark.integration
        ),
        (2, 4, TWO_SLICES, "mesh data=2x1 stage=1 fsdp=2 context=1 expert=1 tensor=2 on 2 slices of 4 devices"),
        pytest.param(
            2,
            4,
            TWO_STAGES,
            "mesh data=1 stage=2x1 fsdp=4 context=1 expert=1 tensor=1 on 2 slices of 4 devices",
            marks=pytest.mark.integration,
        ),
    ],
)
def test_processes_train_like_one(tmp_path, nproc, per_proc, mesh, status):
    run = tmp_path / "run"
    overrides = SMALL + [*mesh, "train.steps=3"]
    args = ["train.log_every=1", "train.eval_batches=1", "train.sample_tokens=8", f"run_dir={run}"]
    done = podtrain(
        "launch",
        "--nproc",
        str(nproc),
        "--devices-per-proc",
        str(per_proc),
        "--",
        "train",
        *overrides,
        *args,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"process 0/{nproc}, {status}" in done.stdout
    assert sorted(p.name for p in (run / "logs").iterdir()) == [f"process_{i}.log" for i in range(nproc)]

    losses, params = run_steps(overrides, n_devices=8)
    logged = [r["loss"] for r in read_metrics(run) if "loss" in r]
    np.testing.assert_allclose(logged, losses, rtol=0, atol=1e-5)
    cfg = load_config(None, SMALL + ["train.eval_batches=1"])
    one_device = build_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    job = build(cfg, one_device)
    checkpointer = Checkpointer(run / "checkpoints")
    restored = checkpointer.restore({"params": job.setup.fns.abstract_params})["params"]
    checkpointer.close()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-5), restored, params)

    # The logged eval loss is the mean over the whole batch, whichever process held which rows.
    logged_val = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]
    np.testing.assert_allclose(logged_val, [job.evaluate(restored)["val_loss"]], rtol=0, atol=1e-5)

    # The closing sample runs on every process over params that span them all; process 0 prints
    # what one device samples from the same weights.
    lines = done.stdout.splitlines()
    printed = lines[lines.index("[0] [podtrain] sample:") + 1].removeprefix("[0] ")
    expected = (
        "The "
        + complete(
            job.setup.fns,
            restored,
            ByteTokenizer(),
            ["The "],
            8,
            Sampling(0.8),
            seeds=[cfg.seed],
            max_len=cfg.train.seq_len,
        )[0]
    )
    assert printed == expected.splitlines()[0]


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.integration)])
def test_each_process_reads_its_own_rows(tmp_path, nproc):
    """Over 3 steps of a (2,2,2) mesh: every window once, none twice, an equal share each."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "podtrain",
            "launch",
            "--nproc",
            str(nproc),
            "--devices-per-proc",
            str(8 // nproc),
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            sys.executable,
            str(TESTS / "multihost_data.py"),
            str(tmp_path),
        ],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reads = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(nproc)]
    for step in map(str, range(3)):
        assert [len(r[step]) for r in reads] == [8 // nproc] * nproc
        assert sorted(sum((r[step] for r in reads), [])) == list(range(int(step) * 8, int(step) * 8 + 8))


@pytest.mark.integration
def test_resume_on_another_process_count(tmp_path):
    """Prepared tokens: 4 steps on 2 processes x 4 devices, resumed on 1 process for 4 more, log
    the losses of 8 uninterrupted steps (a constant learning rate after warmup, so that the
    schedule does not depend on train.steps)."""
    tokens = tmp_path / "tokens"
    fit_bpe(pydoc_documents()[:40], 300, tmp_path / "tok")
    prepare(Corpus("pydoc"), load_tokenizer(str(tmp_path / "tok")), tokens, 0.05, shard_docs=16, quiet=True)
    run = tmp_path / "run"
    overrides = SMALL + [
        "data.source=tokens",
        f"data.path={tokens}",
        "model.vocab_size=384",
        "train.warmup_steps=2",
        "train.min_lr_ratio=1.0",
    ]
    args = [
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "checkpoint.every=2",
        f"run_dir={run}",
    ]
    first = podtrain(
        "launch",
        "--nproc",
        "2",
        "--devices-per-proc",
        "4",
        "--",
        "train",
        *overrides,
        *args,
        "train.steps=4",
        timeout=600,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = podtrain(
        "train",
        *overrides,
        *args,
        "train.steps=8",
        env={"XLA_FLAGS": os.environ["XLA_FLAGS"]},  # eight devices, compiled as the tests compile
        timeout=600,
    )
    assert second.returncode == 0 and "resuming from step 4" in second.stdout and "process 0/1" in second.stdout, (
        second.stdout[-3000:] + second.stderr[-3000:]
    )
    losses, _ = run_steps(overrides + ["train.steps=8"], n_devices=8, n_steps=8)
    np.testing.assert_allclose([r["loss"] for r in read_metrics(run) if "loss" in r], losses, rtol=0, atol=1e-5)


@pytest.mark.integration
def test_launch_fails_fast_when_a_process_dies(tmp_path):
    """With no restart allowed: a non-zero exit soon after the kill, and no process left."""
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "podtrain",
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "4",
            "--max-restarts",
            "0",
            "--",
            "train",
            *SMALL,
            "train.steps=100000",
            "train.log_every=1",
            f"run_dir={run}",
        ],
        env=CLEAN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids, deadline = {}, time.monotonic() + 240
    for line in launcher.stdout:
        if m := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids[int(m[1])] = int(m[2])
        if line.startswith("[0] step      2"):
            break
        assert time.monotonic() < deadline, "training did not start"
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rest = launcher.communicate(timeout=60)[0]
    assert time.monotonic() - killed < 30
    assert launcher.returncode != 0
    assert "process 1 ended with signal SIGKILL" in rest and "restarting" not in rest
    time.sleep(0.5)
    assert not Path(f"/proc/{pids[0]}").exists() or "Z" in Path(f"/proc/{pids[0]}/stat").read_text().split()[2]


HALF_SET = [
    ({"JAX_PROCESS_INDEX": "1"}, "JAX_COORDINATOR_ADDRESS"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_COUNT": "2"}, "JAX_PROCESS_INDEX"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_INDEX": "2"}, "outside 0..1"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_INDEX": "1"}, "not HOST:PORT"),
    (
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_COUNT": "two", "JAX_PROCESS_INDEX": "1"},
        "not an integer",
    ),
    ({"MASTER_ADDR": "127.0.0.1", "RANK": "1", "WORLD_SIZE": "2"}, "MASTER_PORT"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "WORLD_SIZE": "2"}, "RANK (or NODE_RANK"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "WORLD_SIZE": "2", "RANK": "5"}, "outside 0..1"),
]


@pytest.mark.parametrize("env,message", HALF_SET)
def test_half_set_environment_is_an_error(env, message):
    with pytest.raises(DistributedError, match=re.escape(message)):
        from_environment(env)


def test_a_half_set_environment_exits_2_before_joining():
    """As a command meets it: exit 2 with the message and no traceback."""
    env, message = HALF_SET[0]
    done = podtrain("doctor", "device_type=cpu", "distributed.init_timeout=5", env=env, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_missing_processes_time_out_with_the_address(tmp_path):
    """Process 1 of 2 with nobody at the coordinator: exit 2 after the init timeout, naming the address."""
    from podtrain.tools.slots import free_port

    address = f"127.0.0.1:{free_port()}"
    env = {"JAX_COORDINATOR_ADDRESS": address, "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_INDEX": "1"}
    start = time.monotonic()
    done = podtrain("doctor", "device_type=cpu", "distributed.init_timeout=3", env=env, timeout=60)
    assert done.returncode == 2 and address in done.stderr and "Nothing answers" in done.stderr, done.stderr
    assert time.monotonic() - start < 3 + 15  # the timeout plus interpreter start-up


def test_torchrun_variables():
    env = {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "8",
        "NODE_RANK": "1",
        "NPROC_PER_NODE": "4",
        "LOCAL_RANK": "2",
    }
    procs = from_environment(env)
    assert (procs.coordinator, procs.count, procs.index, procs.local_device_ids) == ("10.0.0.1:29500", 8, 6, (2,))
    under_torchrun = from_environment(
        {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    )
    assert under_torchrun.coordinator == "h:29501"  # torchrun's agent holds MASTER_PORT
    assert from_environment({}) is None and from_environment({"LOCAL_RANK": "0"}) is None
    assert (
        from_environment(
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_INDEX": "1", "RANK": "0"}
        ).index
        == 1
    )  # JAX_* first


@pytest.mark.integration
def test_launch_training_script_joins_two_nodes(tmp_path):
    """Two "nodes" on loopback, each running scripts/launch_training.sh with its NODE_RANK: `podtrain
    doctor` on their two processes."""
    from podtrain.tools.slots import free_port

    env = {
        **CLEAN_ENV,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PODTRAIN": f"{sys.executable} -m podtrain",
    }
    script = str(TESTS.parent / "scripts" / "launch_training.sh")
    nodes = [
        subprocess.Popen(
            [script, "doctor", *SMALL, "distributed.init_timeout=60"],
            env={**env, "NODE_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # doctor's every check passes on two processes, the gradient sync against one device's step
    checks = re.findall(r"^\[0\] \[doctor\] ✓ ([\w -]+):", outputs[0], re.M)
    assert checks == ["devices", "data", "train step", "grad sync", "checkpoint", "all-reduce"], outputs[0]
    assert "the 2-device step's update equals a 1-device step's" in outputs[0]
    assert "[0] [doctor] all 6 checks passed, 2 processes" in outputs[0]
