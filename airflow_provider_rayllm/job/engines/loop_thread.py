"""An asyncio event loop on a thread of its own, for synchronous callers on other threads.

Ray Data calls a map actor's ``__call__`` on its own threads, several at once when the actor allows it.
Each call hands its coroutine to the one loop and waits for its own result, so the requests of every
batch in flight share one loop, one connection pool and one in-flight bound, and a batch never waits
for another batch's slowest row. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopDeadline(TimeoutError):
    """A coroutine handed to the loop did not finish within its deadline (it was cancelled)."""


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """The coroutine's result, run on the loop; cancelled and LoopDeadline after ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise LoopDeadline(f"no result within {timeout_s:.0f} s") from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and its thread (a no-op when already closed)."""
        if self.loop.is_closed():
            return
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()
