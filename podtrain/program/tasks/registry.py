"""The tasks by the name a model family's record gives (`Family.task`), so that models import
nothing of training."""

from __future__ import annotations

from podtrain.config.schema import TrainConfig
from podtrain.models.family import Family
from podtrain.program.tasks import Task
from podtrain.program.tasks.language import LanguageTask
from podtrain.program.tasks.puzzles import PuzzleTask

TASKS: dict[str, type[Task]] = {"language": LanguageTask, "puzzles": PuzzleTask}


def task_of(record: Family) -> type[Task]:
    return TASKS[record.task]


def train_config(record: Family) -> type[TrainConfig]:
    """The train keys of a family's task."""
    return task_of(record).train_config
