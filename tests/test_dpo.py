"""Preference tuning (DPO): pairs rendered with the chat template and trained on their replies only,
the loss against DPO's formula computed by hand, a small run that learns the preference, and the
reference kept for a resumed run."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.data import pairs
from podtrain.data.tokenizer import fit_bpe
from podtrain.errors import CheckpointError, ConfigError, DataError
from podtrain.models import build_model
from podtrain.program.load import load_config
from podtrain.program.tasks import preference
from podtrain.program.tasks.language import reply_log_probs
from podtrain.train.loop import train

WORDS = "apple river stone cloud green paper light music table water garden window bread tiger candle".split()  # noqa: SIM905
HELD_OUT = ["forest", "silver", "pocket", "summer", "winter"]  # words no train pair names


def preference_lines(words: list[str]) -> list[dict]:
    """Praise a word, or criticise it: the reply that does as asked is chosen. A random model ranks
    them by chance; the prompt's first word decides."""
    lines = []
    for word in words:
        good, bad = f"{word} is good.", f"{word} is bad."
        lines.append({"prompt": f"Praise {word}.", "chosen": good, "rejected": bad})
        messages = [{"role": "system", "content": "Be fair."}, {"role": "user", "content": f"Criticise {word}."}]
        lines.append({"messages": messages, "chosen": {"role": "assistant", "content": bad}, "rejected": good})
    return lines


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    text = " ".join(json.dumps(line) for line in preference_lines(WORDS + HELD_OUT)) + " user assistant system "
    return fit_bpe([text] * 5, 320, tmp_path_factory.mktemp("dpo_tokenizer"), chat=True)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    file = tmp_path_factory.mktemp("dpo_pairs") / "pairs.jsonl"
    lines = preference_lines(WORDS * 4) + preference_lines(HELD_OUT * 2)  # held out: the last 20 of 140
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return file


def test_pairs_train_exactly_their_replies(tokenizer, tmp_path):
    """Each reply's trained tokens decode to the reply and its end-of-turn text, and nothing of the
    conversation before it (an earlier assistant turn included) is trained."""
    earlier = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Praise bread."},
    ]
    lines = [
        {"prompt": "Praise apple.", "chosen": "apple is good.", "rejected": "apple is bad."},
        {
            "messages": earlier,
            "chosen": {"role": "assistant", "content": "bread is good."},
            "rejected": "bread is bad.",
        },
        {"prompt": "Say it twice.", "chosen": "same", "rejected": "same"},  # nothing to prefer: left out
        {"prompt": "Praise stone. " * 20, "chosen": "stone is good.", "rejected": "stone is bad."},  # too long
        {"prompt": "Praise tiger.", "chosen": "tiger is good.", "rejected": "tiger is bad."},
    ]
    file = tmp_path / "pairs.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    train, val, summary = pairs.pair_rows(str(file), tokenizer, 48, 0.25)
    assert train.shape == (2, 2, 3, 48) and val.shape == (1, 2, 3, 48)
    assert "left out: 1 longer than train.seq_len + 1 = 48 tokens, 1 with the same reply twice" in summary
    for row, line in zip([*train, *val], [lines[0], lines[1], lines[4]]):
        for reply, key in zip(row, ("chosen", "rejected")):
            content = line[key] if isinstance(line[key], str) else line[key]["content"]
            trained = reply[pairs.TRAINED].astype(bool)
            assert tokenizer.decode(reply[pairs.TOKENS][trained]) == content + "<|im_end|>\n"
            assert np.flatnonzero(trained).tolist() == list(range(trained.argmax(), trained.argmax() + trained.sum()))
        assert np.isnan(reply[pairs.REFERENCE, :1].view(np.float32)).all()  # until the reference is run


def test_bad_pair_files_and_configs_are_clear_errors(tokenizer, tmp_path, small_overrides):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Hi.", "chosen": "Hello."}\n')
    with pytest.raises(DataError, match="bad.jsonl:1 is not a preference pair"):
        pairs.read_pairs(str(bad))
    bad.write_text('{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}], '
                   '"chosen": "a", "rejected": "b"}\n')  # fmt: skip
    with pytest.raises(DataError, match="ending before the reply"):
        pairs.read_pairs(str(bad))
    with pytest.raises(ConfigError, match="set data.format=pairs too"):
        load_config(None, [*small_overrides, "train.objective=dpo"])
    with pytest.raises(ConfigError, match="set train.objective=dpo"):
        load_config(None, [*small_overrides, "data.format=pairs", "data.source=text", "data.path=x"])
    with pytest.raises(ConfigError, match="data.format=pairs reads preference pairs from a JSONL file"):
        load_config(None, [*small_overrides, "data.format=pairs", "train.objective=dpo"])


@pytest.mark.parametrize("loss_chunk", [0, 8])
def test_the_loss_is_dpos_formula_on_the_same_log_probabilities(tokenizer, pairs_file, small_overrides, loss_chunk):
    """dpo_loss and its metrics against -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))) in
    numpy, pi summed over the replies' tokens from the model's logits; a padding pair changes nothing."""
    cfg = load_config(None, [*small_overrides, "model.vocab_size=320", f"model.loss_chunk={loss_chunk}"])
    model = build_model(cfg.model, nnx.Rngs(0))
    rows, _, _ = pairs.pair_rows(str(pairs_file), tokenizer, 33, 0.1)
    rows = rows[:6].copy()
    ref = np.random.default_rng(0).normal(-20, 3, (6, 2)).astype(np.float32)
    rows[:, :, pairs.REFERENCE, 0] = ref.view(np.int32)
    beta = 0.3

    def log_prob(tokens, trained):  # by hand: the log-softmax of the model's logits, summed where trained
        table, x, _ = model.features(jnp.asarray(tokens[None, :-1]))
        logits = np.asarray(model.logits(table, x)[0], np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return sum(logp[t, tokens[t + 1]] for t in range(len(tokens) - 1) if trained[t + 1])

    pi = np.array([[log_prob(reply[pairs.TOKENS], reply[pairs.TRAINED]) for reply in row] for row in rows])
    margin = beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
    expected = np.mean(np.log1p(np.exp(-margin)))  # -log sigmoid
    np.testing.assert_allclose(np.asarray(reply_log_probs(model, jnp.asarray(rows))[0]), pi, rtol=2e-5)
    padded = np.concatenate([rows, np.zeros((2, *rows.shape[1:]), np.int32)])
    for batch in (rows, padded):
        loss, (_, metrics) = preference.dpo_loss(model, None, jnp.asarray(batch), None, reply_log_probs, beta)
        np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
        np.testing.assert_allclose(np.divide(*map(float, metrics["dpo_margin"])), margin.mean(), rtol=2e-4)
        assert np.divide(*map(float, metrics["dpo_accuracy"])) == np.mean(margin > 0)
    held_out = preference.dpo_validation(model, jnp.asarray(padded), reply_log_probs, beta)
    assert float(held_out["val_chosen_likelier"][1]) == 6
    assert float(held_out["val_chosen_likelier"][0]) == np.sum(pi[:, 0] > pi[:, 1])


def test_a_small_dpo_run_learns_the_preference_and_resumes_from_its_reference(
    tokenizer, pairs_file, tmp_path, small_overrides, capsys
):
    """From random weights, 24 steps raise the held-out pairs' accuracy from the reference's (by
    chance) to nearly all; a resumed run reads the references kept at step 0 (not the trained
    weights'), and without them, or on other pairs, stops with a clear error."""
    run_dir = tmp_path / "dpo"
    overrides = [
        *small_overrides,
        "model.vocab_size=320",
        "model.max_seq_len=48",
        "train.seq_len=48",  # a pair with its system turn: up to 40 tokens
        "train.objective=dpo",
        "train.dpo_beta=0.5",
        "data.source=text",
        "data.format=pairs",
        f"data.path={pairs_file}",
        f"data.tokenizer={tokenizer.file.parent}",
        "data.val_fraction=0.143",  # the last 20 pairs: the held-out words
        f"run_dir={run_dir}",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        "train.eval_every=24",
        "train.eval_batches=3",
        "train.sample_tokens=0",
        "checkpoint.every=24",
        "log.to=[jsonl]",
    ]
    last = train(load_config(None, [*overrides, "train.steps=24"]))
    first = capsys.readouterr().out
    start = float(re.search(r"likelier in [\d.]+% of train / ([\d.]+)% of held-out", first).group(1)) / 100
    assert "120 train / 20 val preference pairs" in first
    assert last["val_dpo_accuracy"] >= 0.9 and last["val_dpo_accuracy"] > start + 0.2, (start, last)
    assert last["val_chosen_likelier"] >= 0.9 and last["val_dpo_margin"] > 0

    kept = run_dir / preference.REFERENCE_FILE
    saved = kept.read_bytes()
    kept.unlink()
    with pytest.raises(CheckpointError, match="dpo_reference.npz is missing"):
        train(load_config(None, [*overrides, "train.steps=28"]))
    kept.write_bytes(saved)
    other = tmp_path / "other.jsonl"
    other.write_text(pairs_file.read_text().replace("good", "fine"))
    with pytest.raises(DataError, match="are not those whose references"):
        train(load_config(None, [*overrides, f"data.path={other}", "train.steps=28"]))
    capsys.readouterr()
    train(load_config(None, [*overrides, "train.steps=28"]))
    resumed = capsys.readouterr().out
    assert "resuming from step 24" in resumed
    line = re.compile(r"the reference finds .*? held-out pairs")
    assert line.search(resumed).group() == line.search(first).group()  # the kept values, not recomputed
