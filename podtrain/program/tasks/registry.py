"""The tasks by the name a model family's record gives (`Family.task`), and a data source's
(`Source.task`), so that models and data import nothing of training."""

from __future__ import annotations

from podtrain.config.schema import TrainConfig
from podtrain.errors import ConfigError
from podtrain.models import MODELS, family
from podtrain.models.family import Family
from podtrain.program.tasks import Task
from podtrain.program.tasks.language import LanguageTask
from podtrain.program.tasks.puzzles import PuzzleTask

TASKS: dict[str, type[Task]] = {task.name: task for task in (LanguageTask, PuzzleTask)}


def task_of(record: Family) -> type[Task]:
    if record.task not in TASKS:
        raise ConfigError(
            f"model.name={record.name} trains on the task {record.task!r}, which is not registered; its record "
            f"(Family.task) must name one of: {', '.join(TASKS)}."
        )
    return TASKS[record.task]


def families_of(task: type[Task]) -> list[str]:
    """The model families that train on `task`, by name."""
    return [name for name, record in MODELS.items() if task_of(record) is task]


def require_language(model, who: str, needs: str, after: str = "") -> None:
    """A ConfigError unless `model` (a model config) is a language model: `who` trained it, `needs` one."""
    if task_of(family(model)) is not LanguageTask:
        raise ConfigError(
            f"{who} model.name={model.name}, which solves puzzles; {needs} a language model "
            f"({', '.join(families_of(LanguageTask))}).{' ' + after if after else ''}"
        )


def train_config(record: Family) -> type[TrainConfig]:
    """The train keys of a family's task."""
    return task_of(record).train_config
