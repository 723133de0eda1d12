# SPDX-License-Identifier: Apache-2.0
"""Long-lived kvpush tasks end when cancelled.

On Python 3.11 `asyncio.wait_for` returns normally when the task waiting in
it is cancelled in the same loop iteration as its awaitable completes: the
cancellation is lost and the task runs on. Whoever awaits the cancelled task
then waits for ever: an engine's report stream that kept running after its
broker member left held the engine's shard map updates back behind it.
kvpush waits with `asyncio.timeout` instead, which keeps the cancellation.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import sys

from kvpush.connector.report_routing import ReportRouter
from kvpush.connector.report_stream import Report
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("connector", "kvpush", "services", "bench")
RACE_ROUNDS = 20  # the removal below, repeated so one lucky ordering cannot pass it


async def _cancel_as_it_wakes(wait) -> bool:
    """Whether a loop waiting with wait(event, timeout_s) ends when cancelled in the iteration its event is set."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            try:
                await wait(event, 10.0)
            except TimeoutError:
                pass
            event.clear()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1.0)
    if not done:
        task.cancel()  # the second time it is not waking up: it ends
        await asyncio.gather(task, return_exceptions=True)
    return bool(done)


async def _with_timeout(event: asyncio.Event, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await event.wait()


async def test_a_wait_under_asyncio_timeout_keeps_a_cancellation_that_wait_for_would_lose():
    assert await _cancel_as_it_wakes(_with_timeout)
    lost = not await _cancel_as_it_wakes(lambda event, timeout_s: asyncio.wait_for(event.wait(), timeout_s))
    assert lost == (sys.version_info < (3, 12))  # the hazard this module is about, where it exists


def test_kvpush_code_never_waits_with_asyncio_wait_for():
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for source in SOURCES
        for path in sorted((ROOT / source).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\basyncio\.wait_for\(", line)
    ]
    assert offenders == [], "use `async with asyncio.timeout(...)` (see this module's docstring): " + ", ".join(offenders)


class _NoAnswer:
    """A broker member whose EngineReports stream accepts every batch and never answers (the member stalled)."""

    target = "stalled"

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Always connected."""

    def engine_reports(self, engine_id: str):
        return _SilentCall()


class _SilentCall:
    def __init__(self):
        self._ended = asyncio.Event()

    async def write(self, request) -> None:
        return None

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self._ended.wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._ended.set()


async def test_a_member_leaving_while_its_stream_wakes_up_is_removed():
    """The race of the docstring on the real report router: a member is removed in the loop iteration its stream's
    wake-up is set (an item arrives for it); remove_member returns every time and the items go to the member left."""
    loop = asyncio.get_running_loop()
    for _ in range(RACE_ROUNDS):
        router = ReportRouter("decode-0", loop, 5.0, lambda: False, lambda member, address: None)
        router.add_member("m1", _NoAnswer())
        router.add_member("m2", _NoAnswer())
        answered = []
        first = Report("cancels", rv_pb.CancelTransferRequest(key={"transfer_id": "t-0", "attempt": 1}), lambda a, e, out=answered: out.append(e))
        router.send(first)
        await asyncio.sleep(0.01)  # sent: m1's or m2's stream now waits for its answer with a timeout
        member = first.member
        stream = router._streams[member][0]
        stream.put([Report("cancels", rv_pb.CancelTransferRequest(key={"transfer_id": "t-1", "attempt": 1}))])  # wakes it...
        async with asyncio.timeout(2.0):
            await router.remove_member(member, lost=True)  # ...in the iteration it is cancelled
        assert router.members() == {"m1", "m2"} - {member}
        assert [e.reason for e in answered] == ["BROKER_SHARD_LOST"]
        for other in list(router.members()):
            await router.remove_member(other, lost=False)
