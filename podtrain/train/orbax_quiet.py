"""What orbax would print about faults podtrain handles and reports itself.

A damaged checkpoint: orbax runs each batch of checkpoint reads and writes on a fresh event loop of
its own (asyncio_utils.run_sync). When one read fails, e.g. of a truncated file, the exception ends
the loop's main coroutine at once and orbax closes the loop while the sibling reads are still in
tensorstore's hands: each of them, on finishing, calls back into the closed loop, and Python prints
a "RuntimeError: Event loop is closed" traceback per read, dozens for one damaged checkpoint. The
loop is closed here only once its tasks have ended (they fail or finish within the same file
reads), which leaves the failed restore to be reported alone.

A full disk: orbax logs each failed write with its traceback and tensorstore spec (hundreds of
lines); podtrain reports it once (podtrain.train.disk). A save cut short by a kill leaves a
temporary folder, which orbax replaces with a warning when the resumed run saves that step again. A
bucket that fails a save through every retry: orbax logs the failure with its traceback from each
thread it passes through; podtrain reports it once (podtrain.errors.SaveFailed). Those records are
dropped at orbax's logger.
"""

from __future__ import annotations

import asyncio
import logging

from orbax.checkpoint._src import asyncio_utils

from podtrain import storage
from podtrain.train import disk


def _run_to_the_end(coro):
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        if pending := asyncio.all_tasks(loop):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        asyncio.set_event_loop(None)
        loop.close()


class _Handled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message, error = record.getMessage(), record.exc_info[1] if record.exc_info else None
        full = disk.is_full(error) or disk.says_full(message)
        return not (full or storage.failed(error) or "Removing existing directory since it is not finalized" in message)


def quiet_orbax() -> None:
    """Have orbax's run_sync close its loop only after the tasks it started (orbax >= 0.12.8), and
    drop its records of the faults above (it logs through absl's logger)."""
    asyncio_utils._run_sync_via_new_loop = _run_to_the_end
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _Handled) for f in logger.filters):
        logger.addFilter(_Handled())
