"""Completion delivery to threads and to asyncio tasks on several loops, and Once (waiters.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvxferd.transfer.waiters import Completion, Once

PROMPT_S = 3.0  # bound on a wake-up after set(), generous for a loaded machine
WAITER_TIMEOUT_S = 60.0  # the waiters' own timeout: far beyond PROMPT_S


def test_each_waiter_wakes_on_its_own_loop() -> None:
    """Waiters on four loops in four threads all wake within seconds of set(), long before their own timeout."""
    c: Completion[int] = Completion()
    ready = threading.Barrier(5, timeout=5)
    woke: dict[int, int] = {}
    loops: dict[int, asyncio.AbstractEventLoop] = {}

    def run(k: int) -> None:
        async def main() -> None:
            loops[k] = asyncio.get_running_loop()
            task = asyncio.ensure_future(c.wait_async(timeout=WAITER_TIMEOUT_S))
            await asyncio.sleep(0)  # let the task register its future
            ready.wait()
            value = await task
            assert value is not None, "woke at its timeout, not at set()"
            woke[k] = value

        asyncio.run(main())

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    ready.wait()
    woken_by = time.monotonic() + PROMPT_S
    c.set(42)
    try:
        for t in threads:
            t.join(max(0.0, woken_by - time.monotonic()))
        asleep = sorted(set(range(4)) - set(woke))
        # A loop that was never woken sleeps in its selector until the waiter's timeout (seed 001).
        assert not asleep, f"waiters on loops {asleep} still asleep {PROMPT_S:g} s after set()"
        assert woke == {0: 42, 1: 42, 2: 42, 3: 42}
    finally:
        for loop in loops.values():  # wake a stranded loop, so its thread ends now
            try:
                loop.call_soon_threadsafe(lambda: None)
            except RuntimeError:
                pass
        for t in threads:
            t.join(5)


def test_a_closed_loop_does_not_strand_the_others() -> None:
    """A waiter whose loop has closed is skipped; waiters on live loops still wake."""
    c: Completion[str] = Completion()
    dead = asyncio.new_event_loop()
    dead.run_until_complete(asyncio.sleep(0))
    fut = dead.create_future()
    c._futures.append((dead, fut))  # a waiter that registered, then its loop went away
    dead.close()
    got: list[str | None] = []
    ready = threading.Event()

    def live() -> None:
        async def main() -> None:
            task = asyncio.ensure_future(c.wait_async(timeout=5))
            await asyncio.sleep(0)
            ready.set()
            got.append(await task)

        asyncio.run(main())

    t = threading.Thread(target=live)
    t.start()
    assert ready.wait(5)
    c.set("ok")
    t.join(5)
    assert got == ["ok"]


def test_value_is_set_once() -> None:
    """The first value wins; a later set changes nothing."""
    c: Completion[int] = Completion()
    assert c.set(1)
    assert not c.set(2)
    assert c.wait(0) == 1


def test_thread_wait_times_out_with_none() -> None:
    """A blocking wait returns None when its timeout passes first."""
    assert Completion[int]().wait(0.01) is None


@pytest.mark.timeout(10)
def test_once_runs_for_the_first_caller_and_the_others_get_its_result() -> None:
    """Of several threads, exactly one claims; the rest wait for its result within their bound."""
    once: Once[str] = Once()
    gate = threading.Event()
    claims: list[bool] = []
    results: list[str | None] = []
    lock = threading.Lock()

    def caller() -> None:
        first = once.claim()
        with lock:
            claims.append(first)
        if first:
            gate.wait(5)
            once.finish("report")
        else:
            got = once.wait(5)
            with lock:
                results.append(got)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    assert once.wait(0.05) is None, "a waiter returned before the first caller finished"
    gate.set()
    for t in threads:
        t.join(5)
    assert sorted(claims) == [False, False, False, True]
    assert results == ["report"] * 3
    assert once.wait(0) == "report" and not once.claim()


@pytest.mark.timeout(10)
def test_once_run_calls_the_work_once_and_survives_a_failing_first_call() -> None:
    """run() does the work for the first caller only; a first call that raised leaves None."""
    calls: list[int] = []
    once: Once[int] = Once()
    assert once.run(lambda: calls.append(1) or 7, 1.0) == 7
    assert once.run(lambda: calls.append(2) or 8, 1.0) == 7 and calls == [1]

    def boom() -> int:
        raise RuntimeError("first shutdown failed")

    failed: Once[int] = Once()
    with pytest.raises(RuntimeError):
        failed.run(boom, 1.0)
    assert failed.run(lambda: 9, 0.0) is None, "a later caller must not redo or hang on failed work"
