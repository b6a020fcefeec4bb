"""The vLLM worker side's io thread ends its loop cleanly (integrations/vllm/io_thread.py).

A task still pending at shutdown is cancelled and the loop closed, so no task is left for
the garbage collector to destroy pending (its finalizers once ran inside a later test's
``ast.parse`` and tripped CPython 3.11's "AST constructor recursion depth mismatch").
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvxferd.integrations.vllm.io_thread import IoThread
from kvxferd.integrations.vllm.settings import load_settings

pytestmark = pytest.mark.timeout(30)


def test_shutdown_cancels_the_tasks_still_pending_and_closes_the_loop() -> None:
    """A coroutine that never ends on its own is cancelled at shutdown; the loop is closed."""
    io = IoThread(
        load_settings({"engine_socket": "ipc:///nonexistent-kvxferd-dir/engine.sock"}),
        "ipc:///nonexistent-kvxferd-dir/engine.sock",
        "consumer",
        lambda: None,
    )
    started, ended = threading.Event(), threading.Event()
    outcome: list[str] = []

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        finally:
            ended.set()

    io.start()
    io.submit(forever())
    assert started.wait(10), "the task never started"
    io.shutdown()
    assert ended.wait(10) and outcome == ["cancelled"], outcome
    assert io.loop.is_closed(), "the loop was left open with its tasks"
