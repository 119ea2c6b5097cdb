"""AsyncEngine: calls between steps, outputs to the loop, and a failing step reported instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from shared.engine.async_engine import AsyncEngine, EngineFailed


class BrokenEngine:
    """Has work, and its step raises (a bug, a bad tensor): the engine thread cannot go on."""

    def has_unfinished(self) -> bool:
        return True

    def step(self):
        raise RuntimeError("probability tensor contains inf")


def test_a_failing_step_is_reported_and_ends_the_thread():
    async def scenario() -> BaseException:
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        engine = AsyncEngine(BrokenEngine(), on_outputs=lambda _: None, on_failure=failed.set_result)
        engine.start()
        exc = await asyncio.wait_for(failed, 10)
        await asyncio.to_thread(engine._thread.join, 10)
        assert not engine._thread.is_alive()
        return exc

    assert "inf" in str(asyncio.run(scenario()))


def test_calls_after_a_failure_raise_instead_of_waiting():
    async def scenario() -> None:
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        engine = AsyncEngine(BrokenEngine(), on_outputs=lambda _: None, on_failure=failed.set_result)
        engine.start()
        await asyncio.wait_for(failed, 10)
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(engine.call(lambda e: "never"), 5)
        await asyncio.wait_for(engine.stop(), 5)

    asyncio.run(scenario())


def test_calls_run_on_the_engine_thread_and_return_or_raise():
    class Idle:
        def has_unfinished(self) -> bool:
            return False

    async def scenario() -> None:
        engine = AsyncEngine(Idle(), on_outputs=lambda _: None)
        engine.start()
        assert await engine.call(lambda e: 41 + 1) == 42
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda e: 1 / 0)
        assert await engine.call(lambda e: "still serving") == "still serving"
        await engine.stop()

    asyncio.run(scenario())
