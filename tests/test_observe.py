"""What a run shows of itself: goodput whose parts add up to the wall time and find slow data and
recomputed steps; W&B run files (offline) with the scalars and the config, one run id across a
resume; a profile whose trace reads back with real op names."""

import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from podtrain.cli import main
from podtrain.data.loader import BatchReader
from podtrain.program.load import load_config
from podtrain.train import profile
from podtrain.train.loop import train
from podtrain.train.metrics import MetricsLog, read_metrics
from podtrain.train.profile import newest_trace, ops_by_time
from wandb.proto import wandb_internal_pb2 as wandb_pb  # the dev extra installs wandb

SLEEP = 0.15  # seconds the test's data source takes per batch


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: a 7-byte header, then LevelDB-log chunks (checksum 4, length 2,
    type 1, data) in 32 KiB blocks; type 1 is a whole record, 4 the last chunk of one."""
    data, pos, block, chunk, records = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_pb.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_run(run_dir: Path, index: int) -> tuple[str, dict, dict]:
    """(run id, config, {step: train/loss}) of the index-th offline W&B run in a run directory."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # W&B's own process writes the file; on a loaded machine it may still be at it after finish().
    for _ in range(100):
        records = wandb_records(files[index])
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs:
            break
        time.sleep(0.1)
    run = runs[0]
    config = {item.key: item.value_json for item in run.config.update}
    losses = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            if "train/loss" in values:
                losses[int(values["step"])] = float(values["train/loss"])
    return run.run_id, config, losses


def test_goodput_wandb_and_profile_of_a_run_and_its_resume(tmp_path, small_overrides, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    stream = BatchReader.stream

    def slow(self, *args, **kwargs):  # a data source that makes every step wait for its batch
        for batch in stream(self, *args, **kwargs):
            time.sleep(SLEEP)
            yield batch

    monkeypatch.setattr(BatchReader, "stream", slow)
    written = []  # (seconds since train began, prefix, record) of each metrics record
    log_write = MetricsLog.write
    monkeypatch.setattr(
        MetricsLog,
        "write",
        lambda self, record, prefix="train": (
            written.append((time.perf_counter() - began, prefix, record)),
            log_write(self, record, prefix),
        ),
    )
    run = tmp_path / "run"
    args = small_overrides + [
        f"run_dir={run}",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "checkpoint.every=2",
        "log.to=[jsonl,tensorboard,wandb]",
        "log.wandb_tags=[smoke]",
    ]
    began = time.perf_counter()
    train(load_config(None, args + ["train.profile_steps=[3,3]"]))
    at, _, record = next(w for w in written if w[1] == "goodput")
    parts = sum(v for k, v in record.items() if k.endswith("_s") and k != "wall_s")
    assert abs(parts - at) < 0.02 * at, (parts, at, record)  # the parts cover the time train took
    assert record["data_s"] >= 4 * SLEEP and record["productive_steps"] == 4 and record["lost_steps"] == 0
    assert 0 < record["goodput"] < 1 and record["compile_s"] > 0 and record["checkpoint_s"] > 0
    out = capsys.readouterr().out
    assert "[podtrain] goodput " in out and "data " in out and "compile " in out
    memory = next(r for _, prefix, r in written if prefix == "memory")
    assert memory["step"] == 0 and memory["total_bytes"] > memory["params_bytes"] > 0

    run_id, config, losses = wandb_run(run, 0)
    assert run_id == (run / "wandb_id").read_text().strip()
    assert losses == {r["step"]: pytest.approx(r["loss"]) for r in read_metrics(run) if "loss" in r}
    assert '"steps":4' in config["train"] and '"smoke"' in config["log"]

    ops = ops_by_time(newest_trace(run / "profile"))
    assert (newest_trace(run / "profile") / "perfetto_trace.json.gz").is_file()
    assert any("dot" in name or "fusion" in name for name, _, _ in ops[:10]), ops[:10]

    # Resumed from step 2 (as if stopped before the step-4 save): steps 3 and 4 are done again.
    shutil.rmtree(run / "checkpoints" / "4")
    written.clear()
    began = time.perf_counter()
    train(load_config(None, args))
    record = next(r for _, prefix, r in written if prefix == "goodput")
    assert record["lost_steps"] == 2 and record["lost_s"] > 0 and record["productive_steps"] == 0
    assert "lost after resume" in capsys.readouterr().out
    resumed_id, _, resumed_losses = wandb_run(run, 1)
    assert resumed_id == run_id and sorted(resumed_losses) == [3, 4]


def test_wandb_missing_is_an_error_naming_the_extra(small_overrides, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(["train", *small_overrides, "log.to=[jsonl,wandb]"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[wandb]'" in err and "Traceback" not in err


def test_profile_command_lists_the_ops_of_its_trace(tmp_path, small_overrides, capsys):
    assert main(["profile", *small_overrides, f"run_dir={tmp_path}", "--steps", "2", "--top", "5"]) == 0
    out = capsys.readouterr().out
    rows = out.split("share   runs  op\n")[1].splitlines()[:5]
    assert len(rows) == 5 and any("dot" in row or "fusion" in row for row in rows), out
    assert list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))


def test_a_gpus_kernels_count_in_full_where_they_overlap(tmp_path, monkeypatch):
    """A GPU trace has no "XLA Ops" line: its kernels, one line per stream, are the ops. A kernel
    launched before the last one ends (programmatic dependent launch) overlaps it, and still counts
    in full, not as nested in it."""
    kernel = lambda name, start, ns: SimpleNamespace(  # noqa: E731
        name=name, start_ns=start, duration_ns=ns, stats=[("hlo_op", "command_buffer_1")]
    )
    stream = SimpleNamespace(name="Stream #14(Compute)", events=[kernel("gemm", 0, 100), kernel("fusion", 90, 50)])
    host = SimpleNamespace(name="python3", events=[SimpleNamespace(name="step", start_ns=0, duration_ns=200, stats=[])])
    planes = [SimpleNamespace(name="/device:GPU:0", lines=[stream]), SimpleNamespace(name="/host:CPU", lines=[host])]
    monkeypatch.setattr(profile, "ProfileData", SimpleNamespace(from_file=lambda path: SimpleNamespace(planes=planes)))
    (tmp_path / "host.xplane.pb").touch()
    assert ops_by_time(tmp_path) == [("gemm", 100e-9, 1), ("fusion", 50e-9, 1)]
