"""`podtrain eval`: held-out accuracy of HRM/TRM runs against halt_max_steps, as papers report it.

Each run's checkpoint (the latest intact one, or --step; its EMA weights where the run kept an
EMA) is evaluated on the whole test split of its data.path for each halt_max_steps value H
(default: the run's own), as training's evaluation does: every puzzle runs H segments and is
scored on the last, and act_steps is the segment at which the halting rule would first have
stopped. The weights do not depend on H, so any value can be tried; the segments run once, to
the largest H, with each puzzle scored after each H's segment (`score_puzzles`): one compile and
one pass for all values. Puzzles go in batches of train.batch_size (rounded up to a multiple of
the devices), params replicated; the last batch is padded with copies of the first puzzle and the
padding left out of the means, so every test puzzle counts once. The same checkpoint gives the
same numbers.

Per run: a table, RUN_DIR/eval_recursion.png, and one record per value appended to
RUN_DIR/metrics.jsonl at the checkpoint's step: {"step", "eval_halt_max_steps",
"test_cell_accuracy", "test_exact_accuracy", "test_act_steps", "test_loss", "test_puzzles"}
(evaluating again appends again). A resume from that step or a later one keeps them; one from an
earlier step drops them with the other lines past it. With several runs (--seeds expands {seed}
in RUN): mean, min and max over the runs per value, and a pooled plot. One process, like generate.

With --tasks, a language model's run is scored on lm-evaluation-harness tasks instead
(tools/harness.py, docs/evaluation.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from podtrain import storage
from podtrain.data import sudoku
from podtrain.errors import ConfigError
from podtrain.models import family
from podtrain.program.state import model_fns
from podtrain.program.tasks.puzzles import PuzzleTask, score_puzzles
from podtrain.program.tasks.registry import families_of, task_of
from podtrain.sharding import batch_sharding, data_parallel_size, sharded_jit, shardings_of
from podtrain.train.run import Run

SCORES = ("cell_accuracy", "exact_accuracy", "act_steps", "loss")  # of score_puzzles, logged as test_*
PLOT, POOLED = "eval_recursion.png", "eval_recursion_pooled.png"


@dataclass
class Result:
    run: str
    step: int  # of the checkpoint evaluated
    trained: int  # the run's own halt_max_steps
    puzzles: int
    scores: dict[int, dict[str, float]]  # halt_max_steps -> score -> mean over the test puzzles


def numbers(text: str | None, flag: str, least: int) -> list[int] | None:
    """`16,32,64` -> [16, 32, 64]; None stays None."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise ConfigError(f"{flag} takes integers >= {least} separated by commas (e.g. {flag} 16,32,64), not {text!r}.")
    return list(dict.fromkeys(values))


def expand(runs: list[str], seeds: list[int] | None) -> list[str]:
    """Each RUN, or with seeds one run per seed, `{seed}` in RUN replaced by it."""
    if seeds is None:
        if templates := [r for r in runs if "{seed}" in r]:
            raise ConfigError(f"{templates[0]} names {{seed}}: give --seeds (e.g. --seeds 0,1,2) to expand it.")
        return runs
    if plain := [r for r in runs if "{seed}" not in r]:
        raise ConfigError(
            f"--seeds expands {{seed}} in RUN, and {plain[0]} has none; write it as e.g. runs/trm_s{{seed}}."
        )
    return [r.replace("{seed}", str(seed)) for r in runs for seed in seeds]


def open_run(run_dir: str) -> Run:
    """The run, if it trained a puzzle model."""
    run = Run.at(run_dir)
    if task_of(family(run.cfg.model)) is not PuzzleTask:
        raise ConfigError(
            f"{run_dir} trained model.name={run.cfg.model.name}, a language model; eval takes a run of a puzzle "
            f"model ({', '.join(families_of(PuzzleTask))}), or give --tasks to score a language model on "
            "lm-evaluation-harness tasks (e.g. --tasks hellaswag,arc_easy)."
        )
    return run


_SCORERS: dict = {}  # (model config, mesh, halt values) -> score_puzzles jitted on them, compiled once


def scorer(cfg, mesh, halts: tuple[int, ...]):
    """(params, rows) -> score_puzzles after each of `halts` segments, params replicated and rows
    split over the devices."""
    key = (repr(cfg.model), mesh, halts)
    if key not in _SCORERS:
        fns = model_fns(cfg, mesh)
        _SCORERS[key] = sharded_jit(
            lambda params, rows: score_puzzles(fns.module(params), rows, halts),
            mesh,
            in_shardings=(shardings_of(fns.abstract_params), batch_sharding(mesh)),
        )
    return _SCORERS[key]


def evaluate_run(run: Run, halts: list[int] | None, step: int | None = None) -> Result:
    """The run's checkpoint on every test puzzle, for each halt_max_steps value."""
    test = sudoku.load(run.cfg.data.path, "test").rows()
    cfg, fns, step, params = run.model(step)
    mesh, n, halts = fns.mesh, len(test), tuple(sorted(halts or [cfg.model.halt_max_steps]))
    dp = data_parallel_size(mesh)
    size = -(-cfg.train.batch_size // dp) * dp
    rows_PxR = np.concatenate([test, np.repeat(test[:1], -n % size, axis=0)])  # padded to whole batches
    score = scorer(cfg, mesh, halts)
    per_batch = [
        jax.device_get(score(params, jax.device_put(rows_PxR[i : i + size], batch_sharding(mesh))))
        for i in range(0, len(rows_PxR), size)
    ]
    scores_HxN = {k: np.concatenate([s[k] for s in per_batch], axis=1)[:, :n].astype(np.float64) for k in SCORES}
    scores = {halt: {k: float(scores_HxN[k][i].mean()) for k in SCORES} for i, halt in enumerate(halts)}
    return Result(str(run.dir), step, cfg.model.halt_max_steps, n, scores)


def log(result: Result) -> None:
    """One record per halt_max_steps value at the end of RUN_DIR/metrics.jsonl."""
    path = storage.path(result.run) / "metrics.jsonl"
    lines = b""
    for halt, s in result.scores.items():
        record = {"step": result.step, "eval_halt_max_steps": halt, **{f"test_{k}": s[k] for k in SCORES}}
        lines += (json.dumps({**record, "test_puzzles": result.puzzles}) + "\n").encode()
    if storage.is_remote(path):  # an object is replaced whole
        before = path.read_bytes() if path.exists() else b""
        storage.write_bytes(path, before + (b"\n" if before and not before.endswith(b"\n") else b"") + lines)
        return
    with open(path, "a+b") as f:  # writes go to the end wherever the file is read
        if f.tell():
            f.seek(-1, 2)
            f.write(b"" if f.read(1) == b"\n" else b"\n")  # ends a line a killed run left half-written
        f.write(lines)


def pooled(results: list[Result]) -> dict[int, dict[str, tuple[float, float, float]]]:
    """halt_max_steps -> score -> (mean, min, max) over the runs that evaluated that value."""
    out = {}
    for halt in sorted({h for r in results for h in r.scores}):
        values = [r.scores[halt] for r in results if halt in r.scores]
        out[halt] = {
            k: (float(np.mean([v[k] for v in values])), min(v[k] for v in values), max(v[k] for v in values))
            for k in SCORES
        }
    return out


COLUMNS = (  # of the tables; the plots show the first two
    ("cell accuracy", "cell_accuracy", "{:.2%}"),
    ("exact accuracy", "exact_accuracy", "{:.2%}"),
    ("mean ACT steps", "act_steps", "{:.2f}"),
)


def _table(rows: dict[int, list[str]], trained: set[int], width: int) -> list[str]:
    lines = ["  halt_max_steps" + "".join(f"  {title:>{width}}" for title, _, _ in COLUMNS)]
    for halt, cells in rows.items():
        lines.append(f"  {halt:>12}{' *' if halt in trained else '  '}" + "".join(f"  {c:>{width}}" for c in cells))
    return [*lines, "  * the halt_max_steps the run trained with"]


def table(result: Result) -> str:
    head = f"{result.run}: checkpoint step {result.step}, {result.puzzles:,} test puzzles"
    rows = {h: [fmt.format(s[k]) for _, k, fmt in COLUMNS] for h, s in sorted(result.scores.items())}
    return "\n".join([head, *_table(rows, {result.trained}, 14)])


def pooled_table(results: list[Result]) -> str:
    stats = pooled(results)
    head = f"over {len(results)} runs: mean [min, max]"
    rows = {
        h: [f"{fmt.format(s[k][0])} [{fmt.format(s[k][1])}, {fmt.format(s[k][2])}]" for _, k, fmt in COLUMNS]
        for h, s in stats.items()
    }
    counts = {h: sum(h in r.scores for r in results) for h in stats}
    notes = [f"  halt_max_steps={h}: {c} of {len(results)} runs" for h, c in counts.items() if c < len(results)]
    return "\n".join([head, *_table(rows, {r.trained for r in results}, 26), *notes])


def plot(results: list[Result], path: Path) -> Path:
    """Cell and exact accuracy against halt_max_steps, a line per run (a star at the value it
    trained with) and, for several runs, their mean and min-max band."""
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, squeeze=False)
    stats = pooled(results)
    for (title, key, _), ax in zip(COLUMNS, axes[0]):
        for r in results:
            xs = sorted(r.scores)
            (line,) = ax.plot(xs, [r.scores[h][key] for h in xs], "o-", alpha=1 if len(results) == 1 else 0.5)
            line.set_label(f"{storage.path(r.run).name} (step {r.step})")
            if r.trained in r.scores:
                ax.plot([r.trained], [r.scores[r.trained][key]], "*", ms=14, color=line.get_color())
        if len(results) > 1:
            mean, low, high = zip(*(s[key] for s in stats.values()))
            ax.plot(list(stats), mean, "k-", lw=2, label="mean")
            ax.fill_between(list(stats), low, high, color="k", alpha=0.12, label="min-max")
        halts = list(stats)
        if len(halts) > 2 and halts[-1] >= 8 * halts[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(halts, [str(h) for h in halts])
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title(f"held-out {title}")
        ax.set_xlabel("halt_max_steps (segments run; ★ the run's own)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with storage.path(path).open("wb") as f:
        fig.savefig(f, format="png", dpi=100)
    return path


def harness_command(args) -> None:
    """`podtrain eval RUN... --tasks a,b`: lm-eval's tasks on each language model's run."""
    from podtrain.tools import harness  # lm-eval is an optional extra: imported for --tasks alone

    if puzzle := [flag for flag, value in (("--halt-max-steps", args.halt_max_steps), ("--out", args.out)) if value]:
        raise ConfigError(f"{puzzle[0]} is for puzzle runs; with --tasks, leave it out.")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError(
            f"--tasks takes lm-eval task names separated by commas (e.g. hellaswag,arc_easy), not {args.tasks!r}."
        )
    for flag, value, least in (
        ("--limit", args.limit, 1),
        ("--num-fewshot", args.num_fewshot, 0),
        ("--batch-size", args.batch_size, 1),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{flag} takes an integer >= {least}, not {value}.")
    runs = [harness.language_run(Run.at(d)) for d in expand(args.runs, numbers(args.seeds, "--seeds", 0))]
    for run in runs:
        harness.evaluate(run, tasks, args.limit, args.num_fewshot, args.batch_size, args.include_path, args.step)


def command(args) -> None:
    if args.tasks is not None:
        return harness_command(args)
    halts = numbers(args.halt_max_steps, "--halt-max-steps", 1)
    runs = [open_run(d) for d in expand(args.runs, numbers(args.seeds, "--seeds", 0))]  # all checked first
    results = []
    for run in runs:
        results.append(result := evaluate_run(run, halts, args.step))
        log(result)
        plot([result], run.dir / PLOT)
        print(
            table(result) + f"\n[podtrain] wrote {run.dir / PLOT} and {len(result.scores)} records to "
            f"{run.dir / 'metrics.jsonl'}\n",
            flush=True,
        )
    if len(results) > 1:
        out = plot(results, storage.path(args.out) if args.out else runs[0].dir / POOLED)
        print(f"{pooled_table(results)}\n[podtrain] wrote {out}")
