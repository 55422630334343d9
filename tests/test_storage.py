"""Paths in buckets (podtrain.storage) against real servers on 127.0.0.1: fake-gcs-server for gs://
and moto for s3:// (tests/buckets.py). Data, tokenizer, run directory and checkpoints in a bucket
train as a local run does; nothing becomes a local folder named after a scheme; faults are one paragraph."""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pytest
from podtrain import storage
from podtrain.cli import main
from podtrain.errors import RunInUse, StorageError
from podtrain.train import lease
from podtrain.train.metrics import read_metrics

from helpers import SMALL

pytest_plugins = ["buckets"]

RUN = [*SMALL, "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0"]


def _files(tmp_path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))


@pytest.mark.parametrize(
    "args",
    [
        ["train", *RUN, "run_dir=hdfs://cluster/run"],
        ["train", *RUN, "run_dir=run", "checkpoint.dir=az://container/run"],
        ["data", "tokenizer", "--input", "pydoc", "--vocab-size", "300", "--out", "hdfs://cluster/tokenizer"],
        ["plot", "hdfs://cluster/run"],
    ],
)
def test_a_scheme_podtrain_does_not_serve_is_an_error_never_a_folder(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "podtrain: error:" in err and "gs://BUCKET/... and s3://BUCKET/..." in err and "Traceback" not in err
    assert not [f for f in _files(tmp_path) if ":" in f]


def test_a_missing_library_names_the_extra_that_installs_it(monkeypatch):
    real = storage.importlib.util.find_spec
    monkeypatch.setattr(storage.importlib.util, "find_spec", lambda name: None if name == "s3fs" else real(name))
    with pytest.raises(StorageError, match=r"pip install 'podtrain\[s3\]'"):
        storage.path("s3://bucket/run")
    assert storage.path("runs/x") == storage.Path("runs/x")  # local paths need nothing


def _prepare(out: str, tokenizer: str) -> None:
    assert main(["data", "tokenizer", "--input", "pydoc", "--vocab-size", "300", "--out", tokenizer]) == 0
    assert (
        main(["data", "prepare", "--input", "pydoc", "--tokenizer", tokenizer, "--out", out, "--val-fraction", "0.2"])
        == 0
    )


def _losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.integration
def test_a_run_in_a_bucket_trains_resumes_and_reads_as_a_local_one(gcs, tmp_path, monkeypatch, capsys):
    """Tokenizer, shards, run directory and checkpoints in GCS; stopped after 4 steps and resumed to 6:
    every loss equals a local run's of the same data, and nothing lands on the local disk."""
    monkeypatch.chdir(tmp_path)
    bucket, local = gcs.path, tmp_path / "local"
    _prepare(f"{bucket}/shards", f"{bucket}/tokenizer")
    _prepare(str(local / "shards"), str(local / "tokenizer"))
    data = ["data.source=tokens", "model.vocab_size=auto", "checkpoint.every=2"]
    run = f"{bucket}/run"
    for steps in (4, 6):
        assert main(["train", *RUN, *data, f"data.path={bucket}/shards", f"run_dir={run}", f"train.steps={steps}"]) == 0
    assert main(["train", *RUN, *data, f"data.path={local}/shards", f"run_dir={local}/run", "train.steps=6"]) == 0
    assert "resuming from step 4" in capsys.readouterr().out
    remote, expected = _losses(run), _losses(str(local / "run"))
    assert list(remote) == list(range(1, 7))
    np.testing.assert_allclose([remote[s] for s in expected], list(expected.values()), rtol=0, atol=1e-6)

    fs = fsspec.filesystem("gs")
    held = {p.removeprefix(f"{gcs.name}/run/") for p in fs.find(f"{gcs.name}/run")}
    assert {"config.yaml", "metrics.jsonl", "tokenizer/tokenizer.json", "checkpoints/6/commit_success.txt"} <= held
    assert ".lock" not in held and any(name.startswith("events.out.tfevents") for name in held)
    assert json.loads(fs.cat_file(f"{gcs.name}/shards/manifest.json"))["train_tokens"] > 0
    assert not [f for f in _files(tmp_path) if f.startswith("gs:")]

    assert main(["checkpoints", run]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 3 and all(line.split()[0] in ("2", "4", "6") and "verified" in line for line in listed)
    assert main(["generate", run, "--prompt", "The", "--max-new-tokens", "4", "--greedy"]) == 0
    assert main(["plot", run]) == 0 and fs.exists(f"{gcs.name}/run/curves.png")


def test_a_run_directory_in_a_bucket_has_one_writer(gcs):
    run = storage.path(f"{gcs.path}/run")
    with lease.hold(run):
        held = json.loads(fsspec.filesystem("gs").cat_file(f"{gcs.name}/run/.lock"))
        assert held["pid"] == os.getpid()
        with pytest.raises(RunInUse, match=f"{gcs.path}/run is in use by another job"), lease.hold(run):
            pass
    assert not run.joinpath(".lock").exists()  # cleared at the end
    stale = {"host": "elsewhere", "pid": 1, "since": "then", "renewed": 0}
    fsspec.filesystem("gs").pipe_file(f"{gcs.name}/run/.lock", json.dumps(stale).encode())
    with lease.hold(run):  # a lease not renewed for STALE_S is taken over
        assert json.loads(fsspec.filesystem("gs").cat_file(f"{gcs.name}/run/.lock"))["pid"] == os.getpid()


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_a_lease_whose_answer_was_lost_on_the_way_back_is_still_this_jobs(kind, request, faulty_proxy):
    """The lease's create reaches the bucket but its answer is lost: the client's retry finds the
    object there. It is this job's own, not another job's, and the job goes on."""
    bucket = request.getfixturevalue(kind)
    run = storage.path(f"{bucket.path}/run")
    proxy = faulty_proxy(bucket, lose_every=2)  # the bucket's check, then the lease's create: its answer lost
    with lease.hold(run):
        held = json.loads(storage.filesystem(run).cat_file(f"{bucket.name}/run/.lock"))
        assert held["pid"] == os.getpid() and proxy.lost >= 1
    assert not run.joinpath(".lock").exists()


def test_s3_holds_data_and_run_files_and_checkpoints_go_where_orbax_writes(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bucket = s3.path
    _prepare(f"{bucket}/shards", f"{bucket}/tokenizer")
    data = ["data.source=tokens", "model.vocab_size=auto", f"data.path={bucket}/shards", "train.steps=2"]
    assert main(["train", *RUN, *data, f"run_dir={bucket}/run"]) == 2
    assert "orbax writes checkpoint arrays to local paths and gs:// only" in capsys.readouterr().err
    assert main(["train", *RUN, *data, f"run_dir={bucket}/run", f"checkpoint.dir={tmp_path}/checkpoints"]) == 0
    assert list(_losses(f"{bucket}/run")) == [1, 2] and (tmp_path / "checkpoints" / "2").is_dir()
    assert not [f for f in _files(tmp_path) if f.startswith("s3:")]


@pytest.mark.parametrize("fault", ["no bucket", "no object", "no credentials"])
def test_a_store_that_cannot_serve_the_run_is_one_paragraph(fault, gcs, s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if fault == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask on this machine
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        args, said = [f"run_dir={s3.path}/run", f"checkpoint.dir={tmp_path}/c"], "no credentials to reach the bucket"
    elif fault == "no bucket":
        args, said = ["run_dir=gs://podtrain-no-such-bucket/run"], "the bucket podtrain-no-such-bucket does not exist"
    else:
        args, said = [f"run_dir={tmp_path}/run", "data.source=tokens", f"data.path={gcs.path}/none"], "no manifest.json"
    assert main(["train", *RUN, "train.steps=1", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    out = storage.path(folder)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load(f.read_bytes()).items()}


def test_convert_writes_to_and_reads_from_a_bucket_every_tensor_equal(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run, hf, imported = f"{gcs.path}/run", f"{gcs.path}/hf", f"{gcs.path}/imported"
    assert main(["train", *RUN, "train.steps=1", "checkpoint.every=0", f"run_dir={run}"]) == 0
    assert main(["convert", "--to-hf", run, str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert main(["convert", "--to-hf", run, hf, "--dtype", "float32"]) == 0
    assert main(["convert", "--from-hf", hf, imported]) == 0
    assert main(["convert", "--to-hf", imported, f"{gcs.path}/again", "--dtype", "float32"]) == 0
    local, there, again = _tensors(str(tmp_path / "hf")), _tensors(hf), _tensors(f"{gcs.path}/again")
    assert local.keys() == there.keys() == again.keys() and len(local) > 5
    for name, tensor in local.items():
        np.testing.assert_array_equal(there[name], tensor)
        np.testing.assert_array_equal(again[name], tensor)
    assert storage.path(f"{hf}/config.json").is_file() and not [f for f in _files(tmp_path) if f.startswith("gs:")]


def test_processes_of_a_host_that_copy_a_bucket_folder_at_once_each_get_a_whole_copy(gcs, tmp_path, monkeypatch):
    """The processes of one host load a bucket's tokenizer at once: each that finds no copy of the
    version fetches it whole into a folder of its own, renamed into place, so none reads another's
    half-made copy; one that finds the copy there fetches nothing, even while another still fetches.
    Nothing locks: each that looks before the first rename fetches the version once, and the losers
    drop theirs. A changed object is a new version; a file is copied under its own name."""
    files = {"tokenizer.json": b'{"one": 1}', "nested/config.json": b"{}"}
    for name, data in files.items():
        storage.write_bytes(f"{gcs.path}/tok/{name}", data)
    monkeypatch.setenv("PODTRAIN_CACHE", str(tmp_path))
    fs, fetched, loader = storage.filesystem(gcs.path), [], threading.local()
    get_file = fs.get_file
    second_fetching, late_loaded = threading.Event(), threading.Event()

    def get_file_in_order(remote, local, **kwargs):  # the race forced, never left to timing
        who = getattr(loader, "name", "main")
        fetched.append((who, remote))
        if who == "first":  # renames into place only once `second` is fetching its own
            assert second_fetching.wait(10)
        elif who == "second":  # which ends only after two later loads have read the first's copy
            second_fetching.set()
            assert late_loaded.wait(10)
        return get_file(remote, local, **kwargs)

    monkeypatch.setattr(fs, "get_file", get_file_in_order)

    def load(name: str) -> dict[str, bytes]:
        loader.name = name
        folder = storage.local_copy(f"{gcs.path}/tok")
        return {f: (folder / f).read_bytes() for f in files}

    with ThreadPoolExecutor(4) as pool:
        racing = [pool.submit(load, name) for name in ("first", "second")]
        assert racing[0].result(timeout=30) == files
        assert [pool.submit(load, name).result(timeout=30) for name in ("third", "fourth")] == [files] * 2
        late_loaded.set()
        assert racing[1].result(timeout=30) == files  # its rename lost; it reads the first's copy
    objects = sorted(f"{gcs.name}/tok/{f}" for f in files)
    assert sorted(fetched) == [("first", o) for o in objects] + [("second", o) for o in objects], fetched
    assert storage.local_copy(f"{gcs.path}/tok") and len(fetched) == 4
    storage.write_bytes(f"{gcs.path}/tok/tokenizer.json", b'{"two": 2}')
    changed = storage.local_copy(f"{gcs.path}/tok")
    assert (changed / "tokenizer.json").read_bytes() == b'{"two": 2}' and len(fetched) == 4 + 2
    file = storage.local_copy(f"{gcs.path}/tok/nested/config.json")
    assert file.name == "config.json" and file.read_bytes() == b"{}"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no fetch left behind


def test_a_step_a_save_left_incomplete_in_a_bucket_is_never_restored(gcs, tmp_path, monkeypatch, capsys):
    """A save cut short (the store or the job dying) leaves a step's folder without orbax's commit
    marker: resuming passes it by for the newest complete step, and training ends as if uninterrupted."""
    monkeypatch.chdir(tmp_path)
    run, fs = f"{gcs.path}/run", fsspec.filesystem("gs")
    job = [*RUN, "checkpoint.every=2", "train.warmup_steps=2", "train.min_lr_ratio=1.0"]
    assert main(["train", *job, "train.steps=4", f"run_dir={run}"]) == 0
    fs.rm(f"{gcs.name}/run/checkpoints/4/commit_success.txt")  # written last of a step, as it commits
    assert main(["train", *job, "train.steps=6", f"run_dir={run}"]) == 0
    assert "resuming from step 2" in capsys.readouterr().out
    assert main(["train", *job, "train.steps=6", f"run_dir={tmp_path}/local"]) == 0
    remote, expected = _losses(run), _losses(str(tmp_path / "local"))
    np.testing.assert_allclose([remote[s] for s in expected], list(expected.values()), rtol=0, atol=1e-6)


def test_rows_that_may_wait_on_a_bucket_are_read_by_threads_and_come_out_in_order(gcs, monkeypatch):
    from podtrain.data import tokens
    from podtrain.data.loader import REMOTE_READERS, LocalRows, train_windows

    corpus = np.arange(50_000, dtype=np.uint16)
    storage.write_bytes(f"{gcs.path}/train-00000.npy", _npy(corpus))
    monkeypatch.setattr(tokens, "BLOCK", 4096)  # 25 blocks of which the cache holds one:
    monkeypatch.setattr(tokens, "CACHE_BLOCKS", 1)  # the corpus is larger than the block cache
    stream = tokens.TokenStream([f"{gcs.path}/train-00000.npy"], [len(corpus)])
    assert stream.beyond_cache and not tokens.TokenStream(["local.npy"], [len(corpus)]).beyond_cache
    windows, _ = train_windows(stream, 32, 8, seed=0)
    one, many = (LocalRows(windows, 8, np.arange(8), readers) for readers in (1, REMOTE_READERS))
    for batch in range(5):
        np.testing.assert_array_equal(many(batch), one(batch))
    in_memory, _ = train_windows(corpus, 32, 8, seed=0)
    np.testing.assert_array_equal(one(3), LocalRows(in_memory, 8, np.arange(8))(3))


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_orbax_records_of_a_save_the_bucket_failed_are_left_to_the_one_paragraph(caplog):
    """A restarted server forgets an upload in progress; orbax logs the failure with its traceback from
    each thread it passes, and podtrain reports it once (errors.SaveFailed), so those records go."""
    import logging

    from podtrain.train.orbax_quiet import quiet_orbax

    quiet_orbax()
    logger = logging.getLogger("absl")
    for error in (FileNotFoundError("http://127.0.0.1:9/upload/storage/v1/b/bkt/o?upload_id=1"), ValueError("a bug")):
        try:
            raise error
        except Exception:
            logger.error("Failed to run 3 Handler Commit operations: %s", type(error).__name__, exc_info=True)
    assert [r.getMessage() for r in caplog.records] == ["Failed to run 3 Handler Commit operations: ValueError"]


def test_generate_reads_prompts_from_a_bucket_and_eval_writes_its_results_there(gcs, tmp_path, monkeypatch, capsys):
    from pathlib import Path

    tasks = Path(__file__).parent / "data" / "harness"
    monkeypatch.chdir(tasks)  # the task's data_files are relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run, prompts = f"{gcs.path}/run", f"{gcs.path}/prompts.jsonl"
    assert main(["train", *RUN, "train.steps=1", "checkpoint.every=0", f"run_dir={run}"]) == 0
    storage.write_text(storage.path(prompts), '{"prompt": "The "}\n{"prompt": "A"}\n')
    capsys.readouterr()
    assert main(["generate", run, "--prompts", prompts, "--max-new-tokens", "4", "--greedy"]) == 0
    assert [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()] == ["The ", "A"]
    assert main(["eval", run, "--tasks", "podtrain_choice", "--include-path", str(tasks), "--limit", "2"]) == 0
    results = json.loads(storage.path(f"{run}/eval/1/results.json").read_text())
    assert "acc,none" in results["results"]["podtrain_choice"]
    assert not [f for f in _files(tasks) if f.startswith("gs:")] and not _files(tmp_path)
