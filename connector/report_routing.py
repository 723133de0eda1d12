# SPDX-License-Identifier: Apache-2.0
"""An engine's reports, each on the EngineReports stream of the broker member that owns its transfer.

A sharded broker splits transfers among its members by rendezvous hashing
of transfer_id (kvpush.shards); an engine keeps one ReportStream per member
(the ControlSession adds and removes them as the shard map changes) and
sends each item to its transfer's owner, so a rank holds O(members)
streams. An unsharded broker is one member (""): every item goes on its one
stream, exactly as without sharding, with no hashing and no extra message.
A write result goes instead to the member whose order it answers
(Report.to) while that member has a stream: a member that lost a transfer
to a newcomer still holds the attempt and fences it by these answers.

An item answered NOT_SHARD_OWNER (the member's map differs from ours: a
member joined or left and we have not heard yet) goes again to the owner
that answer names, on that member's stream (opened for it if our map does
not list it yet), at most MAX_REDIRECTS times; unless our map saw that
owner leave (the answering member has not heard yet): the item then goes
again to its owner by our map after a pause, as below, rather than to a
member that is gone.

An item answered BROKER_SHARD_LOST by a member that is not serving (it
cannot be sure of its membership lease, after an etcd election say, and
refuses everything before looking at it) goes again to its transfer's owner
after a pause, RETRY_FIRST_S doubling to RETRY_MAX_S, while it is younger
than the RPC timeout: the member applied nothing, so the repeat doubles
nothing, and the member serving again (or the map without it) takes it;
otherwise the item would fail and its request wait for its deadline.

When a member leaves, the
items it was never sent go to their new owners; those it was sent and did
not answer are answered Unavailable (BROKER_SHARD_LOST): whether it applied
them is unknown, as after a unary call whose server died. The seed ("")
giving way to a sharded map is not a loss: it was one of the members, and
its unanswered items go again to their owners (a repeat is idempotent).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvpush import errors, shards
from kvpush.client import BrokerClient
from kvpush.connector.report_stream import Report, ReportStream, deliver

logger = logging.getLogger(__name__)

# The member id of an unsharded broker, and of the seed before a sharded map arrived (kvpush.client.shard_map.UNSHARDED).
SEED = ""
# NOT_SHARD_OWNER answers one item follows: members' maps converge within a watch round trip, so more means a fault.
MAX_REDIRECTS = 2


# Pauses before an item a non-serving member refused goes again: a member unsure of its lease takes a new
# one and serves again within a backoff step (0.1-2 s), a lapsed one leaves the map within its lease ttl.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 0.8

# How long a cancelled stream task gets to end before its member is removed without it.
STOP_WAIT_S = 5.0


async def stop_tasks(tasks: Sequence[asyncio.Future], what: str) -> None:
    """Cancels tasks and waits (bounded) for them to end: a task that outlives its cancellation must not hold back
    every later change of the shard map behind it."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    ended, alive = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
    for task in ended:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("kvpush: %s had failed: %r", what, task.exception())
    if alive:
        logger.error("kvpush: %s did not end within %gs of its cancellation; going on without it", what, STOP_WAIT_S)


class ReportRouter:
    """Routes an engine's reports to its members' ReportStreams; lives on a ControlSession's loop (send from any thread)."""

    def __init__(self, engine_id: str, loop: asyncio.AbstractEventLoop, timeout_s: float, closed: Callable[[], bool],
                 client_for: Callable[[str, str], BrokerClient]):
        """client_for(member, address): the client of a member a NOT_SHARD_OWNER answer named."""
        self._engine_id = engine_id
        self._loop = loop
        self._timeout_s = timeout_s
        self._closed = closed
        self._client_for = client_for
        self._streams: dict[str, tuple[ReportStream, asyncio.Future]] = {}
        self._sharded = False  # a member other than the seed was ever added: items' owners are tracked (on_route)
        self._departed: set[str] = set()  # members that left our map (and have not joined it again)
        self._parked: list[Report] = []  # items that came while no member was known

    # ---- any thread ----------------------------------------------------------------------

    def send(self, report: Report) -> None:
        """Queues one item (any thread)."""
        self.send_many([report])

    def send_many(self, reports: list[Report]) -> None:
        """Queues items (any thread); those for one member leave together in one message."""
        if reports and not self._closed():
            self._loop.call_soon_threadsafe(self._arrive, reports)

    # ---- control loop --------------------------------------------------------------------

    def members(self) -> set[str]:
        return set(self._streams)

    def add_member(self, member: str, broker: BrokerClient) -> None:
        """Opens the member's stream (nothing if it has one); items waiting for any member go out."""
        if member in self._streams:
            return
        stream = ReportStream(broker, self._engine_id, self._loop, self._timeout_s, self._closed, reroute=self._reroute)
        self._streams[member] = (stream, asyncio.ensure_future(stream.run()))
        self._departed.discard(member)
        self._sharded = self._sharded or member != SEED
        parked, self._parked = self._parked, []
        self._route(parked)

    async def remove_member(self, member: str, *, lost: bool) -> None:
        """Closes the member's stream. Items it was never sent go to their owners now; lost: those it was sent are answered BROKER_SHARD_LOST."""
        entry = self._streams.pop(member, None)
        if entry is None:
            return
        if lost:
            self._departed.add(member)
        stream, task = entry
        await stop_tasks([task], f"EngineReports stream of broker member {member!r}")
        again = []
        for report in stream.take_pending():
            if lost and report.sent:
                deliver(report, None, errors.Unavailable(f"broker member {member} left the shard map before answering",
                                                         reason=errors.Reason.BROKER_SHARD_LOST))
            else:
                again.append(report)
        self._route(again)

    def _arrive(self, reports: list[Report]) -> None:
        expires = self._loop.time() + self._timeout_s
        for report in reports:
            report.expires = expires
        self._route(reports)

    def _route(self, reports: list[Report], member: str | None = None) -> None:
        """Queues each item for member, or for its transfer's owner among the members with a stream."""
        if not reports:
            return
        if not self._streams:
            self._park(reports)
            return
        groups: dict[str, list[Report]] = {}
        if member is None and len(self._streams) == 1:
            member = next(iter(self._streams))  # unsharded: no hashing
        for report in reports:
            if member is not None:
                owner = member
            elif report.to is not None and report.to in self._streams:
                owner = report.to
            else:
                found = shards.owner(report.message.key.transfer_id, self._streams)
                assert found is not None, "there is a stream (checked above), so an owner among their members"
                owner = found
            report.member, report.sent = owner, False
            if self._sharded and report.on_route is not None:
                report.on_route(owner)
            groups.setdefault(owner, []).append(report)
        for owner, items in groups.items():
            self._streams[owner][0].put(items)

    def _park(self, reports: list[Report]) -> None:
        """No member to send to (every one left): items wait for the next one, or are answered at their expiry."""
        self._parked += reports
        self._loop.call_at(min(r.expires for r in reports), self._expire_parked)

    def _expire_parked(self) -> None:
        now = self._loop.time()
        expired = [r for r in self._parked if r.expires <= now]
        self._parked = [r for r in self._parked if r.expires > now]
        for report in expired:
            deliver(report, None, errors.Unavailable(f"no broker member to send to within {self._timeout_s:g}s",
                                                     reason=errors.Reason.BROKER_SHARD_LOST))

    def _reroute(self, report: Report, error: errors.KvpushError) -> bool:
        """A shard refusal (the member applied nothing): the item goes on (True), or its sender gets the error (False)."""
        if error.reason == errors.Reason.NOT_SHARD_OWNER:
            return self._redirect(report, error)
        return self._retry_later(report)

    def _retry_later(self, report: Report) -> bool:
        """A member that is not serving (or not caught up) refused the item: it goes again, after a pause, to its transfer's owner then."""
        delay = min(RETRY_FIRST_S * 2 ** report.retries, RETRY_MAX_S)
        if self._loop.time() + delay >= report.expires:
            return False
        report.retries += 1
        self._loop.call_later(delay, self._send_again, report)
        return True

    def _send_again(self, report: Report) -> None:
        if not self._closed():
            self._route([report])

    def _redirect(self, report: Report, error: errors.KvpushError) -> bool:
        """A NOT_SHARD_OWNER answer: the item goes to the owner it names (True), or gets the error (False)."""
        owner, address = error.metadata.get("owner_member_id", ""), error.metadata.get("owner_address", "")
        if owner in self._departed and owner not in self._streams:
            return self._retry_later(report)  # the answering member's map is older than ours: it will hear of it
        if not owner or owner == report.member or report.redirects >= MAX_REDIRECTS:
            return False
        if owner not in self._streams:
            if not address:
                return False
            logger.info("kvpush: broker member %s (%s) is not in this engine's shard map yet; reporting to it anyway", owner, address)
            self.add_member(owner, self._client_for(owner, address))
        report.redirects += 1
        self._route([report], owner)
        return True
