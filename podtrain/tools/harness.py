"""`podtrain eval RUN --tasks`: a run's checkpoint scored on lm-evaluation-harness tasks with
podtrain's adapter (program/harness.py), lm-eval's table printed and its results kept in
RUN_DIR/eval/STEP/results.json."""

from __future__ import annotations

import json

from podtrain import storage
from podtrain.program.harness import PodtrainLM, check_names, lm_eval, load_tasks, task_manager
from podtrain.program.tasks.registry import require_language
from podtrain.train.run import Run

# the keys of lm-eval's results that map each task (or group) to its entry
PER_TASK = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def language_run(run: Run) -> Run:
    """The run, if it trained a language model."""
    after = "Leave --tasks out to score a puzzle run on its test set."
    require_language(run.cfg.model, f"{run.dir} trained", "--tasks scores", after)
    return run


def evaluate(
    run: Run,
    tasks: list[str],
    limit: int | None,
    num_fewshot: int | None,
    batch_size: int,
    include_path: str | None,
    step: int | None = None,
) -> dict:
    """lm-eval's `tasks` on the run's checkpoint (the latest, or `step`): a table printed, and
    lm-eval's results (without the samples) in RUN_DIR/eval/STEP/results.json, beside those of the
    other tasks evaluated at that step. Returns lm-eval's results, each request's in "samples"."""
    language_run(run)
    manager = task_manager(include_path)
    check_names(tasks, manager)
    loaded = load_tasks(tasks, manager)
    cfg, fns, step, params = run.model(step)
    model = PodtrainLM(cfg, fns, params, run.tokenizer(), batch_size)
    results = lm_eval.simple_evaluate(
        model=model, tasks=loaded, limit=limit, num_fewshot=num_fewshot, task_manager=manager, log_samples=True
    )
    results["config"] |= {
        "model": f"podtrain {cfg.model.name}",
        "batch_size": batch_size,
        "run": str(run.dir),
        "step": step,
    }
    print(lm_eval.utils.make_table(results))
    if results.get("groups"):
        print(lm_eval.utils.make_table(results, "groups"))
    folder = run.dir / "eval" / str(step)
    storage.makedirs(folder)
    path = folder / "results.json"
    before = json.loads(path.read_text()) if path.exists() else {}
    kept = {k: v for k, v in results.items() if k != "samples"}
    kept |= {k: before.get(k, {}) | kept[k] for k in PER_TASK if k in kept}  # the step's other tasks stay
    storage.write_text(path, json.dumps(kept, indent=2, default=lm_eval.utils.handle_non_serializable))
    print(f"[podtrain] wrote {path}")
    return results
