"""Damaged checkpoints are found by their checksums, set aside and skipped; a resume with other
shapes names the keys; remote checkpoint paths reach orbax untouched; `podtrain checkpoints`."""

import asyncio
import errno
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from podtrain.cli import main
from podtrain.errors import CheckpointError, DiskFull
from podtrain.program.load import load_config
from podtrain.train.loop import train
from podtrain.train.metrics import read_metrics

# A damaged checkpoint's failed reads end quietly: a callback into a closed event loop is an error here.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def _args(small_overrides, run, steps):
    return [
        *small_overrides,
        f"run_dir={run}",
        f"train.steps={steps}",
        "train.log_every=1",
        "checkpoint.every=2",
        "checkpoint.async_save=false",
        "train.eval_every=0",
        "train.eval_batches=1",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps with checkpoints at 2 and 4, and the losses of steps 3 and 4."""
    from helpers import SMALL

    run = tmp_path_factory.mktemp("faults") / "run"
    train(load_config(None, _args(SMALL, run, 4)))
    return run, {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def _data_files(folder: Path) -> list[Path]:
    """Every chunk file: which of them hold the live arrays depends on how the save's writes were batched."""
    return [p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"]


def _swap_values(folder: Path) -> None:
    """Readable files holding other values: the same arrays from the previous checkpoint."""
    shutil.rmtree(folder)
    shutil.copytree(folder.parent.parent / "2" / folder.name, folder)


def _zero_bytes(folder: Path) -> None:
    for data in _data_files(folder):
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(b"\0" * 100)


def _truncate(folder: Path) -> None:
    for data in _data_files(folder):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _delete(folder: Path) -> None:
    for data in _data_files(folder):
        data.unlink()


@pytest.mark.parametrize("damage", [_zero_bytes, _truncate, _delete, _swap_values])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(
    trained, small_overrides, tmp_path, capsys, damage
):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    damage(run / "checkpoints" / "4" / "params")
    capsys.readouterr()
    last = train(load_config(None, _args(small_overrides, run, 4)))
    out = capsys.readouterr().out
    assert (
        "the checkpoint at step 4 is damaged" in out
        and "resuming from step 2, the newest intact checkpoint; set aside as 4.damaged" in out
    )
    assert (run / "checkpoints" / "4.damaged" / "params").is_dir()  # kept for a post-mortem
    assert last["loss"] == pytest.approx(trained[1][4], abs=1e-6)  # steps 3 and 4 again, the same
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]
    assert [(r["step"], r["restarts"], r["recomputed_steps"]) for r in read_metrics(run) if "restarts" in r] == [
        (2, 0, 2)  # steps 3 and 4, logged before and computed again
    ]


def test_a_failed_read_comes_back_after_its_sibling_reads_have_ended(tmp_path):
    """orbax closes its event loop only once the reads it started have ended, so that none of
    them calls back into a closed loop (a traceback each on the terminal)."""
    from orbax.checkpoint._src import asyncio_utils
    from podtrain.train.checkpoint import Checkpointer

    Checkpointer(tmp_path).close()
    ended = []

    async def sibling():
        await asyncio.sleep(0.05)
        ended.append("sibling")

    async def truncated():
        raise OSError("a truncated chunk")

    async def reads():
        await asyncio.gather(sibling(), truncated())

    with pytest.raises(OSError, match="truncated chunk"):
        asyncio_utils.run_sync(reads())
    assert ended == ["sibling"]


def test_a_full_disk_stops_the_run_with_one_paragraph(small_overrides, tmp_path, monkeypatch, capsys, caplog):
    """The disk fills up once step 2 is saved: a warning before the save of step 4, whose writer
    fails with ENOSPC in orbax's background thread; the run ends with one paragraph naming the
    step, the free space and the newest intact step, no orbax record, and the partial save gone."""
    from orbax.checkpoint._src.serialization import serialization
    from podtrain.train import disk

    run = tmp_path / "run"

    def full() -> bool:
        return (run / "checkpoints" / "2").is_dir()

    write, usage = serialization.async_serialize_from_host, shutil.disk_usage

    async def writer(*args, **kwargs):
        if full():
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write(*args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", writer)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage(path)._replace(free=0) if full() else usage(path))
    args = [*_args(small_overrides, run, 4), "checkpoint.async_save=true"]
    with pytest.raises(
        DiskFull,
        match=r"checkpoint of step 4 could not be written to .*checkpoints: its disk is full \(0.0 MiB free, a "
        r"checkpoint of this run needs about 0.3 MiB\). The newest intact checkpoint is step 2; run the same",
    ):
        train(load_config(None, args))
    err = capsys.readouterr().err
    assert "has 0.0 MiB free and a checkpoint of this run takes about 0.3 MiB: the save of step 4 will" in err
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]


def test_no_intact_checkpoint_lists_what_was_found_and_renames_nothing(trained, small_overrides, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    _swap_values(run / "checkpoints" / "4" / "params")
    _truncate(run / "checkpoints" / "2" / "opt")
    with pytest.raises(
        CheckpointError,
        match=r"No intact checkpoint .*step 4: .* differ from their recorded checksums.*; "
        r"step 2: its (files|metadata) cannot be read.*Nothing was renamed",
    ):
        train(load_config(None, _args(small_overrides, run, 6)))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def test_resuming_with_other_shapes_names_the_differing_keys(trained, small_overrides, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    other = [*_args(small_overrides, run, 6), "model.d_ff=96"]
    with pytest.raises(
        CheckpointError,
        match=r"params/layers/mlp/w_gate is float32\[2, 32, 64\] there, float32\[2, 32, 96\] here.*"
        r"config.yaml differs from this config in: model.d_ff \(64 there, 96 here\); train.steps \(4 there, 6 here\)",
    ):
        train(load_config(None, other))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]  # not mistaken for damage


def test_checkpoints_lists_steps_and_whether_each_verifies(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    _zero_bytes(run / "checkpoints" / "4" / "opt")
    capsys.readouterr()
    assert main(["checkpoints", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["verified"]) for r in rows] == [(2, True), (4, False)]
    assert rows[0]["bytes"] > 0 and len(rows[0]["digest"]) == 16 and rows[0]["digest"] != rows[1]["digest"]
    assert main(["checkpoints", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "verified" in lines[0] and "DAMAGED" in lines[1]


def test_a_half_written_metrics_line_is_dropped_on_resume(trained, small_overrides, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    train(load_config(None, _args(small_overrides, run, 6)))
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6] and np.all(np.isfinite([r["loss"] for r in read_metrics(run) if "loss" in r]))


@pytest.mark.parametrize("shape", [(), (6,), (6, 10), (4, 6, 8), (2, 4, 6, 7)])
def test_checksums_are_their_definition_on_any_sharding(shape):
    """[sum of bits, sum of bits * (2i+1)] modulo 2**32 over row-major indices i, as numpy computes
    it on the host, for the array whole and sharded over a 2x2x2 mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from podtrain.config.parallel import MeshConfig
    from podtrain.runtime.mesh import build_mesh
    from podtrain.train.digest import checksums

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    index = np.arange(bits.size, dtype=np.uint64)
    expected = [int(bits.sum() % 2**32), int((bits * (2 * index + 1) % 2**32).sum() % 2**32)]
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
    spec = PartitionSpec(*("data", "fsdp", "tensor", None)[: len(shape)])
    sharded = jax.device_put(x, NamedSharding(mesh, spec))
    assert (
        checksums({"x": sharded})
        == checksums({"x": jax.device_put(x, NamedSharding(mesh, PartitionSpec()))})
        == {"x": expected}
    )
