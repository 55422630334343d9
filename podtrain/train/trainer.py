"""The trainer: the step, and hooks that run after it every N steps (levanter's trainer).

Everything besides the step (metrics, evaluation, checkpoints, divergence, stop requests, the
progress bar) is a hook with a period, forced after the last step (torchtitan's
`checkpointer.save(step, last_step=...)`), so the loop reads in a few lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class StepEnd:
    """What a hook sees: the step just done (1-based), the state after it and its metrics (on device)."""

    done: int
    last: int  # the run's final step
    state: dict
    metrics: dict


@dataclass
class Hook:
    fn: Callable[[StepEnd], None]
    every: int  # steps between calls; 0: only after the last step

    def due(self, done: int, last: int) -> bool:
        return done == last or (self.every > 0 and done % self.every == 0)


@dataclass
class Trainer:
    step: Callable  # (state, batch) -> (state, metrics)
    hooks: list[Hook] = field(default_factory=list)

    def add_hook(self, fn: Callable[[StepEnd], None], every: int = 1) -> None:
        self.hooks.append(Hook(fn, every))

    def run(self, state: dict, batches: Iterable, start: int, last: int) -> dict:
        """Steps start+1 .. last, one batch each, with the hooks due after each; the final state."""
        for done, batch in zip(range(start + 1, last + 1), batches):
            state, metrics = self.step(state, batch)
            end = StepEnd(done, last, state, metrics)
            for hook in self.hooks:
                if hook.due(done, last):
                    hook.fn(end)
        return state
