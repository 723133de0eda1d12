# SPDX-License-Identifier: Apache-2.0
"""The connector's control session against `kvpush broker --etcd` members as real processes on a real 3-member etcd.

The decode engine reaches the broker at one member's address, follows the
shard map from it, registers each destination at its transfer's owner, and
when the other member is killed (SIGKILL) and its etcd lease lapses, fails
the requests that member held with BROKER_SHARD_LOST while keeping their
blocks; new transfers then go to the member left.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import time

from sharded_brokers import WAIT_S, deployment

from kvpush import shards
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.params import TransferParams
from kvpush.connector.report_stream import Report
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import ManualClock


def owned_by(member_id: str, member_ids, skip: int = 0) -> str:
    """The transfer id after the first `skip` that hash to member_id among member_ids."""
    owned = (f"t{i}" for i in itertools.count() if shards.owner(f"t{i}", member_ids) == member_id)
    return next(itertools.islice(owned, skip, None))


async def eventually(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_killed_members_waiting_requests_fail_with_broker_shard_lost_and_keep_their_blocks(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        token = (plane.tokens_dir / "decode-0").read_text().strip()
        config = ConnectorConfig(engine_id="decode-0", role="decode", control_plane=plane.brokers["b1"].address, token=token, rpc_timeout_s=2.0)
        session = ControlSession(config, "test-sharded-processes")
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        session.on_member_left(lambda member, members: inbox.put(("member_left", member, members)))
        clock = ManualClock()
        waits = DecodeWaits(clock, hold_margin_s=2.0)
        answers: dict[str, tuple] = {}

        def register(transfer_id: str) -> None:
            key = (transfer_id, 1)
            waits.admit(f"d-{transfer_id}", TransferParams("decode", transfer_id, 1, "prefill-0", None, "", ""), "", 10.0, 0)
            waits.registered(f"d-{transfer_id}")
            reports.send(Report("registrations", sample.destination_request(transfer_id),
                                lambda answer, error: answers.__setitem__(transfer_id, (answer, error)),
                                on_route=lambda member: inbox.put(("routed", key, member))))

        def drain() -> None:
            while not inbox.empty():
                kind, *args = inbox.get()
                getattr(waits, kind)(*args)

        try:
            reports = session.report_stream("decode-0")
            events = rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1")
            session.follow_members("StreamTransferEvents", lambda broker: broker.stream_transfer_events(events),
                                   lambda member: lambda message: inbox.put(("on_event", message.event)))
            await eventually(lambda: session.members() == {"b1", "b2"})
            both = {"b1", "b2"}
            t1, t2 = owned_by("b1", both), owned_by("b2", both)
            register(t1)
            register(t2)
            await eventually(lambda: len(answers) == 2)
            assert [answers[t][1] for t in (t1, t2)] == [None, None]
            assert {answers[t][0].response.state for t in (t1, t2)} == {tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL}
            await plane.brokers["b2"].kill()
            await eventually(lambda: session.members() == {"b1"}, timeout_s=WAIT_S)  # b2's lease lapsed; b1's map says so
            await asyncio.sleep(0.1)
            drain()
            lost = waits.get(f"d-{t2}")
            assert lost.member == "b2" and lost.failure.startswith("END_REASON_BROKER_SHARD_LOST") and not lost.safe
            assert not waits.get(f"d-{t1}").failure
            assert waits.due() == ({}, [])  # its blocks wait for its deadline + hold margin
            t3 = owned_by("b2", both, skip=1)  # b2's before: b1's now
            register(t3)
            await eventually(lambda: t3 in answers)
            assert answers[t3][1] is None and answers[t3][0].response.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            clock.advance(12.0)
            fails, _ = waits.due()
            assert fails[f"d-{t2}"].startswith("END_REASON_BROKER_SHARD_LOST")
        finally:
            session.close()


async def test_a_member_restarted_on_its_address_takes_reports_at_once_when_it_rejoins(tmp_path, etcd_cluster, etcd_prefix, caplog):
    """b2 is killed, leaves the map, and rejoins from a new process on the same address: the engine's new stream to it opens on the first try.

    Connections to b2 kept failing meanwhile on the seed's channels (one
    multi-address target of every member); the channel opened for the
    rejoined member has connections of its own, so it neither inherits that
    failure nor waits for their next reconnection attempt.
    """
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        seed = "ipv4:" + ",".join(plane.brokers[m].address for m in ("b1", "b2"))
        token = (plane.tokens_dir / "decode-0").read_text().strip()
        config = ConnectorConfig(engine_id="decode-0", role="decode", control_plane=plane.registrar.address, broker=seed, token=token, rpc_timeout_s=5.0)
        session = ControlSession(config, "test-sharded-rejoin")
        answers: dict[str, tuple] = {}

        async def register(transfer_id: str) -> float:
            """Sends one registration; how long its answer took."""
            start = time.monotonic()
            reports.send(Report("registrations", sample.destination_request(transfer_id), lambda answer, error: answers.__setitem__(transfer_id, (answer, error))))
            await eventually(lambda: transfer_id in answers)
            assert answers[transfer_id][1] is None
            return time.monotonic() - start

        try:
            reports = session.report_stream("decode-0")
            await eventually(lambda: session.members() == {"b1", "b2"})
            both = {"b1", "b2"}
            await register(owned_by("b2", both))
            await plane.brokers["b2"].kill()
            await eventually(lambda: session.members() == {"b1"}, timeout_s=WAIT_S)
            await plane.brokers["b2"].restart()
            await eventually(lambda: session.members() == both, timeout_s=WAIT_S)
            caplog.clear()
            assert await register(owned_by("b2", both, skip=1)) < 0.5
            assert [r.getMessage() for r in caplog.records if r.name == "kvpush.connector.report_stream"] == []
        finally:
            session.close()
