"""orbax's event loops, closed only once every task on them has ended.

orbax runs each batch of checkpoint reads and writes on a fresh event loop of its own
(asyncio_utils.run_sync). When one read fails, e.g. of a truncated file, the exception ends the
loop's main coroutine at once and orbax closes the loop while the sibling reads are still in
tensorstore's hands: each of them, on finishing, calls back into the closed loop, and Python prints
a "RuntimeError: Event loop is closed" traceback per read, dozens for one damaged checkpoint.
Letting the siblings end first (they fail or finish within the same file reads) leaves the failed
restore to be reported alone.
"""

from __future__ import annotations

import asyncio

from orbax.checkpoint._src import asyncio_utils


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


def finish_tasks_before_closing() -> None:
    """Have orbax's run_sync close its loop only after the tasks it started (orbax >= 0.12.8)."""
    asyncio_utils._run_sync_via_new_loop = _run_to_the_end
