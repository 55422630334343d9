"""lm-evaluation-harness as podtrain's evaluator (tools/harness.py): a small trained run scores as
lm-eval's own `hf` model scores the run's float32 export, request by request, on a multiple-choice,
a generation and a perplexity task (tests/data/harness: YAMLs over local JSONL files, offline);
results.json keeps every task of a step; bad input is one paragraph and exit 2."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from podtrain.cli import main
from podtrain.data.tokenizer import fit_bpe
from podtrain.program import harness as adapter
from podtrain.program.load import load_config
from podtrain.program.saved import save_config
from podtrain.tools import harness
from podtrain.train.loop import train
from podtrain.train.run import Run

from helpers import RECURSION, SMALL, TINY

TASKS = Path(__file__).parent / "data" / "harness"
CHOICE, GENERATE, ROLLING = "podtrain_choice", "podtrain_generate", "podtrain_rolling"
SENTENCES = (
    "the cat sat on the mat. the dog ran in the park. one two three four five six seven eight nine ten. "
    "the bird sings in the tree. the old man reads the book by the fire. the apple is red.\n"
    "Question: Where does the cat sit?\nAnswer: on the mat\nQuestion: What is red?\nAnswer: the apple\n"
)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub: datasets reads the tasks' local files, from the folder their data_files are relative to."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(TASKS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Llama of SMALL's sizes with 64 positions, 60 steps on SENTENCES (val_loss ~0.9) with a fitted BPE (whose
    tokenizer.json the export carries, for the hf model), exported in float32 to RUN/hf."""
    root = tmp_path_factory.mktemp("harness")
    (root / "corpus.txt").write_text(SENTENCES * 40)
    fit_bpe([SENTENCES] * 5, 300, root / "tokenizer")
    overrides = [
        *SMALL,
        "model.max_seq_len=64",
        "train.seq_len=64",
        "model.vocab_size=384",
        "data.source=text",
        "data.format=text",
        f"data.path={root / 'corpus.txt'}",
        f"data.tokenizer={root / 'tokenizer'}",
        f"run_dir={root / 'run'}",
        "train.steps=60",
        "train.lr=1e-2",
        "train.warmup_steps=5",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "log.to=[jsonl]",
    ]
    train(load_config(None, overrides))
    assert main(["convert", "--to-hf", str(root / "run"), str(root / "run" / "hf"), "--dtype", "float32"]) == 0
    return root / "run"


def hf_results(run, tasks, **options) -> dict:
    """lm-eval's `hf` model on the run's float32 export."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={run / 'hf'},dtype=float32",
        tasks=tasks,
        batch_size=4,
        device="cpu",
        task_manager=adapter.task_manager(str(TASKS)),
        log_samples=True,
        **options,
    )


def responses(results, task) -> list:
    """Each document's responses, one per request, in document order."""
    return [[r[0] for r in s["resps"]] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_scores_equal_lm_evals_hf_model_on_the_float32_export(run):
    """Each choice's log-likelihood within 1e-4 of the hf model's and the same accuracy (two shots
    make contexts longer than the 64 positions: both cut them the same way); the same greedy
    generations and exact match; the same perplexity over documents longer than one window."""
    ours = harness.evaluate(Run.at(run), [CHOICE, ROLLING], None, 2, 4, str(TASKS))
    theirs = hf_results(run, [CHOICE, ROLLING], num_fewshot=2)
    mine, hf = np.array(responses(ours, CHOICE), dtype=object), np.array(responses(theirs, CHOICE), dtype=object)
    ll = np.array([[c[0] for c in doc] for doc in mine]), np.array([[c[0] for c in doc] for doc in hf])
    assert ll[0].shape == (6, 3) and np.abs(ll[0] - ll[1]).max() < 1e-4, np.abs(ll[0] - ll[1]).max()
    assert [[c[1] for c in doc] for doc in mine] == [[c[1] for c in doc] for doc in hf]  # is_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][CHOICE][metric] == theirs["results"][CHOICE][metric], metric
    documents = np.array(responses(ours, ROLLING)), np.array(responses(theirs, ROLLING))
    assert np.abs(documents[0] - documents[1]).max() < 1e-4 * np.abs(documents[1]).max()
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"][ROLLING][metric] == pytest.approx(theirs["results"][ROLLING][metric], rel=1e-4)

    ours, theirs = harness.evaluate(Run.at(run), [GENERATE], None, None, 4, str(TASKS)), hf_results(run, [GENERATE])
    assert responses(ours, GENERATE) == responses(theirs, GENERATE)
    assert len({text for doc in responses(ours, GENERATE) for text in doc}) > 1  # not one text for every prompt
    assert ours["results"][GENERATE]["exact_match,none"] == theirs["results"][GENERATE]["exact_match,none"]

    # results.json of the step: every task evaluated there, each with its latest scores
    kept = json.loads((run / "eval" / "60" / "results.json").read_text())
    assert set(kept["results"]) == {CHOICE, ROLLING, GENERATE} and kept["n-shot"][CHOICE] == 2
    assert kept["config"]["step"] == 60 and "samples" not in kept


def test_the_command_prints_the_table(run, capsys):
    assert main(["eval", str(run), "--tasks", CHOICE, "--include-path", str(TASKS), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert f"|{CHOICE}" in out.replace(" ", "") and "acc_norm" in out and "results.json" in out


def refused(capsys, *argv) -> str:
    """The one paragraph of a refused `podtrain eval`."""
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("podtrain: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_what_eval_tasks_refuses(run, tmp_path, capsys):
    include = ["--include-path", str(TASKS)]
    err = refused(capsys, str(run), "--tasks", f"{CHOICE},podtrain_choise", *include)
    assert "'podtrain_choise' (close: podtrain_choice" in err and "lm-eval ls tasks" in err
    err = refused(capsys, str(run), "--tasks", "podtrain_missing", *include)
    assert "--tasks podtrain_missing" in err and "absent.jsonl" in err and "relative to the directory" in err
    err = refused(capsys, str(run))
    assert "give --tasks" in err
    puzzle = tmp_path / "trm"
    puzzle.mkdir()
    save_config(load_config(None, [*TINY, *RECURSION["trm"]]), puzzle / "config.yaml")
    err = refused(capsys, str(puzzle), "--tasks", CHOICE, *include)
    assert "model.name=trm, which solves puzzles" in err and "--tasks scores a language model" in err
    err = refused(capsys, str(run), "--tasks", CHOICE, "--halt-max-steps", "2")
    assert "--halt-max-steps is for puzzle runs" in err


def test_without_lm_eval_tasks_ask_for_the_extra(run, monkeypatch, capsys):
    import podtrain.program
    import podtrain.tools

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    for module in (podtrain.tools, podtrain.program):
        monkeypatch.delitem(sys.modules, f"{module.__name__}.harness")
        monkeypatch.delattr(module, "harness")
    assert "pip install 'podtrain[eval]'" in refused(capsys, str(run), "--tasks", CHOICE)


def test_tasks_in_the_loop_are_logged_at_their_steps_survive_a_resume_and_equal_podtrain_eval(run, tmp_path):
    """eval.tasks every 4 steps of a run continued from the fixture's weights: eval/TASK/METRIC in
    metrics.jsonl at steps 4 and 8, kept by a resume to 12; the last equals `podtrain eval` of that checkpoint."""
    from podtrain.train.metrics import read_metrics

    saved = load_config(run / "config.yaml")
    loop = [f"train.init_from={run}", f"run_dir={tmp_path / 'loop'}", "train.lr=1e-4", "train.warmup_steps=0"]
    tasks = [f"eval.tasks=[{CHOICE}]", "eval.every=4", f"eval.include_path={TASKS}", "checkpoint.every=4"]
    cfg = load_config(None, [*saved_overrides(saved), *loop, *tasks, "train.steps=8"])
    train(cfg)
    train(load_config(None, [*saved_overrides(saved), *loop, *tasks, "train.steps=12"]))
    scored = {r["step"]: r for r in read_metrics(tmp_path / "loop") if f"eval/{CHOICE}/acc" in r}
    assert sorted(scored) == [4, 8, 12]
    assert {f"eval/{CHOICE}/acc", f"eval/{CHOICE}/acc_norm"} <= set(scored[12])
    after = harness.evaluate(Run.at(tmp_path / "loop"), [CHOICE], None, None, 8, str(TASKS))
    assert after["results"][CHOICE]["acc,none"] == scored[12][f"eval/{CHOICE}/acc"]


def saved_overrides(cfg) -> list[str]:
    """The fixture's data and model keys, as overrides of a new run."""
    m, d = cfg.model, cfg.data
    return [
        *SMALL,
        f"model.max_seq_len={m.max_seq_len}",
        f"train.seq_len={cfg.train.seq_len}",
        f"model.vocab_size={m.vocab_size}",
        "data.source=text",
        "data.format=text",
        f"data.path={d.path}",
        f"data.tokenizer={d.tokenizer}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "log.to=[jsonl]",
    ]
