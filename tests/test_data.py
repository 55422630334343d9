"""Real data: sources, a fitted tokenizer, prepared shards, packing, document masks, bad data."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.data.loader import train_windows
from podtrain.data.prepare import is_validation, prepare
from podtrain.data.sources import Corpus
from podtrain.data.tokenizer import load_tokenizer
from podtrain.data.tokens import TokenStream, load_manifest
from podtrain.program.tasks.language import document_ids
from podtrain.train.metrics import read_metrics

from helpers import SMALL, run_steps

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "from",
    "every",
    "loud",
    "noise",
    "in",
    "town",
]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(5, 60))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """300 documents as JSON lines, with a fitted tokenizer and prepared shards beside them."""
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "docs.jsonl", "w") as f:
        for i, text in enumerate(documents(300)):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    assert (
        main(
            [
                "data",
                "tokenizer",
                "--input",
                str(root / "docs.jsonl"),
                "--vocab-size",
                "300",
                "--out",
                str(root / "tok"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(root / "docs.jsonl"),
                "--tokenizer",
                str(root / "tok"),
                "--out",
                str(root / "shards"),
                "--shard-docs",
                "64",
                "--val-fraction",
                "0.1",
            ]
        )
        == 0
    )
    return root


def test_fitted_tokenizer_loads_in_transformers(corpus):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(str(corpus / "tok")), AutoTokenizer.from_pretrained(str(corpus / "tok"))
    text = "the cat sat on a mat. Ünïcode → bytes"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == 300 and theirs.eos_token_id == ours.eos_id == 0


def test_saved_dataset_and_jsonl_give_the_same_shards(corpus, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": documents(300)}).save_to_disk(str(tmp_path / "saved"))
    tokenizer = load_tokenizer(str(corpus / "tok"))
    manifest = prepare(Corpus(str(tmp_path / "saved")), tokenizer, tmp_path / "shards", 0.1, shard_docs=64, quiet=True)
    ours = load_manifest(corpus / "shards")
    assert manifest["train_tokens"] == ours["train_tokens"] and manifest["documents"] == 300
    for split in ("train", "val"):
        a, b = TokenStream.of(tmp_path / "shards", manifest, split), TokenStream.of(corpus / "shards", ours, split)
        np.testing.assert_array_equal(a[0 : len(a)], b[0 : len(b)])


def test_threads_reading_a_stream_open_its_shards_once_one_header_at_a_time(corpus, monkeypatch):
    """The loader's threads read one stream at once; a `.npy` header is parsed by ast.literal_eval, which
    CPython 3.11 cannot run in two threads at once (a SystemError), so the shards open once, in one thread."""
    stream = TokenStream.of(corpus / "shards", load_manifest(corpus / "shards"), "train")
    load, lock, opened, now, most = np.load, threading.Lock(), [], [0], [0]

    def slow_load(*args, **kwargs):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)  # wide enough for another thread to come in
        opened.append(args[0])
        with lock:
            now[0] -= 1
        return load(*args, **kwargs)

    monkeypatch.setattr(np, "load", slow_load)
    start = threading.Barrier(4)

    def read(i):
        start.wait()
        return stream[i * 100 : i * 100 + 50]

    with ThreadPoolExecutor(4) as pool:
        windows = list(pool.map(read, range(4)))
    assert most[0] == 1 and sorted(opened) == sorted(stream.files)
    monkeypatch.undo()
    for i, window in enumerate(windows):
        np.testing.assert_array_equal(window, stream[i * 100 : i * 100 + 50])


def test_packing_puts_every_token_in_an_epoch_once(corpus):
    """Documents end with EOS, in corpus order; an epoch's windows, in any order, hold every
    token once as an input, but for the last partial window's."""
    tokenizer = load_tokenizer(str(corpus / "tok"))
    manifest = load_manifest(corpus / "shards")
    stream = TokenStream.of(corpus / "shards", manifest, "train")
    train_docs = [d for i, d in enumerate(documents(300)) if not is_validation(i, 0.1)]
    expected = np.concatenate([ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(train_docs)])
    np.testing.assert_array_equal(stream[0 : len(stream)], expected)
    assert len(manifest["shards"]) == 5  # windows cross shard boundaries

    seq = 16
    windows, n = train_windows(stream, seq, 8, seed=0)
    epoch = np.stack([windows[i] for i in range(n)])
    starts = sorted(int(w[0]) for w in epoch)  # shuffled, but a permutation of the n windows
    inputs = np.sort(np.concatenate([w[:-1] for w in epoch]))
    np.testing.assert_array_equal(inputs, np.sort(expected[: n * seq]))
    assert len(expected) - n * seq <= seq and len(starts) == n
    assert not np.array_equal(
        np.stack([windows[i] for i in range(n)]), np.stack([windows[n + i] for i in range(n)])
    )  # reshuffled


def test_segment_ids_keep_attention_inside_documents():
    from flax import nnx
    from podtrain.models import build_model
    from podtrain.program.load import load_config

    eos = 0
    tokens = jnp.array([[5, 6, 7, eos, 8, 9, eos, 10]])
    np.testing.assert_array_equal(document_ids(tokens, eos)[0], [0, 0, 0, 0, 1, 1, 1, 2])
    cfg = load_config(None, SMALL + ["model.vocab_size=16"])
    model = build_model(cfg.model, nnx.Rngs(0))
    changed = tokens.at[0, 1].set(11)  # a token of the first document
    for segments, second_document_moves in ((document_ids(tokens, eos), False), (None, True)):
        a, b = model(tokens, segment_ids=segments), model(changed, segment_ids=segments)
        np.testing.assert_allclose(a[0, :1], b[0, :1])  # before the change: causal
        assert not np.allclose(a[0, 1:4], b[0, 1:4])  # the changed document sees it
        assert (not np.allclose(a[0, 4:], b[0, 4:])) == second_document_moves


@pytest.mark.parametrize("reset_positions", [True, False])
def test_a_packed_windows_loss_is_its_documents_losses_run_alone(reset_positions):
    """Three documents packed in one window: each document's next-token losses equal those of the
    document run alone, at positions from 0 (data.reset_positions) or from its place in the window."""
    from flax import nnx
    from podtrain.models import build_model
    from podtrain.program.load import load_config
    from podtrain.program.tasks.language import document_positions, token_losses

    eos = 0
    docs = [[5, 6, 7, 3, eos], [8, 9, 4, 2, 11, 12, eos], [10, 13, 14, 6]]
    window = jnp.asarray([sum(docs, [])])
    cfg = load_config(None, [*SMALL, "model.vocab_size=16", "model.rope_theta=50"])
    model = build_model(cfg.model, nnx.Rngs(0))
    segments = document_ids(window, eos)
    np.testing.assert_array_equal(document_positions(segments)[0], [*range(5), *range(7), *range(4)])
    inputs, targets = window[:, :-1], window[:, 1:]
    forward = nnx.jit(lambda model, *args: model(*args))
    positions = document_positions(segments[:, :-1]) if reset_positions else None
    losses = token_losses(forward(model, inputs, segments[:, :-1], positions), targets)[0]
    start = 0
    for doc in docs:
        doc = jnp.asarray([doc])
        positions = jnp.arange(doc.shape[1] - 1)[None] + (0 if reset_positions else start)
        alone = token_losses(forward(model, doc[:, :-1], None, positions), doc[:, 1:])[0]
        np.testing.assert_allclose(losses[start : start + len(alone)], alone, rtol=1e-5, atol=1e-5)
        start += doc.shape[1]


def test_train_on_prepared_tokens_with_auto_vocab(corpus, tmp_path):
    run = tmp_path / "run"
    args = [
        *SMALL,
        "data.source=tokens",
        f"data.path={corpus / 'shards'}",
        "model.vocab_size=auto",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=4",
    ]
    assert main(["train", *args, "data.pack=documents", f"run_dir={run}"]) == 0
    assert "vocab_size: 384" in (run / "config.yaml").read_text()  # 300 rounded up to 128s
    assert load_tokenizer(str(run / "tokenizer")).identity == load_tokenizer(str(corpus / "tok")).identity
    logged = [r for r in read_metrics(run) if "loss" in r]
    assert [r["epoch"] for r in logged] == [0, 0, 0, 0] and all(np.isfinite(r["loss"]) for r in logged)
    losses, _ = run_steps([*args, "data.pack=documents"], n_devices=8, n_steps=4)
    np.testing.assert_allclose([r["loss"] for r in logged], losses, rtol=0, atol=1e-5)
    concat, _ = run_steps(args, n_devices=8, n_steps=1)
    assert abs(concat[0] - losses[0]) > 1e-6  # the mask changes what the model sees


def test_an_interrupted_prepare_continues(corpus, tmp_path):
    tokenizer = load_tokenizer(str(corpus / "tok"))
    source = Corpus(str(corpus / "docs.jsonl"))

    class Interrupted(Corpus):
        def documents(self):
            for i, doc in enumerate(source.documents()):
                if i == 150:
                    raise KeyboardInterrupt
                yield doc

    with pytest.raises(KeyboardInterrupt):
        prepare(Interrupted(source.input), tokenizer, tmp_path / "shards", 0.1, shard_docs=64, quiet=True)
    assert sorted(p.name for p in (tmp_path / "shards").glob("shard-*.json")) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    with pytest.raises(Exception, match="not a folder of prepared tokens.*did not finish"):
        load_manifest(tmp_path / "shards")
    manifest = prepare(source, tokenizer, tmp_path / "shards", 0.1, shard_docs=64, quiet=True)
    assert manifest["shards"] == load_manifest(corpus / "shards")["shards"]
    for f in (corpus / "shards").glob("*.npy"):
        assert f.read_bytes() == (tmp_path / "shards" / f.name).read_bytes()


def test_hub_datasets_are_streamed_by_datasets(tmp_path):
    """A folder laid out like a hub dataset repo with configs: read by `datasets.load_dataset`
    exactly as a hub name would be (--dataset-name picks the config)."""
    repo = tmp_path / "smollm-corpus"
    (repo / "cosmopedia-v2").mkdir(parents=True)
    (repo / "other").mkdir()
    (repo / "cosmopedia-v2" / "train-00000.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in documents(20))
    )
    (repo / "other" / "train-00000.jsonl").write_text(json.dumps({"text": "not this one"}) + "\n")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: cosmopedia-v2\n  data_files:\n"
        "  - split: train\n    path: cosmopedia-v2/*.jsonl\n"
        "- config_name: other\n  data_files:\n  - split: train\n    path: other/*.jsonl\n---\n"
    )
    assert list(Corpus(str(repo), dataset_name="cosmopedia-v2").documents()) == documents(20)


def data_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("podtrain: error: ") and "Traceback" not in err
    return err


def test_bad_corpora_are_named(tmp_path, capsys, corpus):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "fields.jsonl").write_text(
        json.dumps({"text": "fine"}) + "\n" + json.dumps({"content": "no text"}) + "\n"
    )
    tok = ["--tokenizer", str(corpus / "tok")]
    assert "has no text to train on" in data_error(
        capsys, ["data", "prepare", "--input", str(tmp_path / "empty"), *tok, "--out", str(tmp_path / "o1")]
    )
    assert "latin1.txt is not UTF-8 text: byte 3 (line 1)" in data_error(
        capsys, ["data", "prepare", "--input", str(tmp_path / "latin1.txt"), *tok, "--out", str(tmp_path / "o2")]
    )
    err = data_error(
        capsys, ["data", "prepare", "--input", str(tmp_path / "fields.jsonl"), *tok, "--out", str(tmp_path / "o3")]
    )
    assert "fields.jsonl, line 2 has no field `text` (it has: content)" in err
    assert "data.source=pydoc reads the built-in text" in data_error(
        capsys, ["train", "--dataset", "HuggingFaceTB/smollm-corpus"]
    )
    err = data_error(capsys, ["train", "data.source=tokens", f"data.path={tmp_path / 'o3'}"])
    assert "not a folder of prepared tokens" in err and "rerun that `podtrain data prepare`" in err


def test_out_of_range_ids_and_another_tokenizer_are_refused(tmp_path, capsys, corpus):
    shards = f"data.path={corpus / 'shards'}"
    base = [
        "train",
        *SMALL,
        "data.source=tokens",
        shards,
        "train.steps=2",
        "train.sample_tokens=0",
        "checkpoint.every=1",
    ]
    assert "token ids up to 299" in data_error(capsys, [*base, "model.vocab_size=256", f"run_dir={tmp_path / 'a'}"])

    other = tmp_path / "other_tok"
    assert (
        main(["data", "tokenizer", "--input", str(corpus / "docs.jsonl"), "--vocab-size", "280", "--out", str(other)])
        == 0
    )
    err = data_error(capsys, [*base, "model.vocab_size=384", f"data.tokenizer={other}", f"run_dir={tmp_path / 'b'}"])
    assert "were made with the tokenizer" in err and "Leave data.tokenizer=auto" in err

    # A run trained on bytes cannot resume on these shards; its checkpoints stay.
    run = tmp_path / "bytes_run"
    assert (
        main(["train", *SMALL, "train.steps=2", "train.sample_tokens=0", "checkpoint.every=1", f"run_dir={run}"]) == 0
    )
    assert "was trained with another tokenizer" in data_error(
        capsys, [*base, "model.vocab_size=384", "train.steps=4", f"run_dir={run}"]
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


def test_unreachable_hub_names_are_errors(tmp_path, corpus):
    """In a fresh process: huggingface_hub and datasets read HF_HUB_OFFLINE when imported."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}

    def refused(*args) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "podtrain",
                "data",
                "prepare",
                "--input",
                "nobody/no-such-dataset",
                *args,
                "--out",
                str(tmp_path / "o"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            done.returncode == 2 and done.stderr.startswith("podtrain: error: ") and "Traceback" not in done.stderr
        ), done.stderr
        return done.stderr

    assert "Could not get the tokenizer `nobody/no-such-model`" in refused("--tokenizer", "nobody/no-such-model")
    err = refused("--dataset-name", "x", "--tokenizer", str(corpus / "tok"))
    assert "Could not read the dataset nobody/no-such-dataset (x)" in err and "reaches huggingface.co" in err
