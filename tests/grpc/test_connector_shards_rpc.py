# SPDX-License-Identifier: Apache-2.0
"""The connector's control session against a sharded broker: real grpc.aio members (stream_members), real NIXL for P.

One EngineReports stream and one follower per member; each report goes to
its transfer's owner, a NOT_SHARD_OWNER answer sends it to the owner it
names; a lost member stream stops only that member's orders at P; a member
leaving the map fails D's requests it owned (BROKER_SHARD_LOST) while their
blocks stay held. An unsharded broker gets today's streams, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Iterator

import pytest
from stream_members import Cluster, StreamMember, stream_members

from kvpush import errors, shards
from kvpush.clock import ManualClock
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlSession
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.handoff import SourceReady
from kvpush.connector.params import TransferParams
from kvpush.connector.report_stream import Report
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from tests.sharding import owned
from tests.unit.nixl_pair import transfer_threads
from tests.waiting import eventually

ORDERS, EVENTS = "StreamWriteOrders", "StreamTransferEvents"


@contextlib.contextmanager
def session_on(seed: str, engine_id: str = "decode-0", role: str = "decode") -> Iterator[ControlSession]:
    """A session whose broker (seed) is apart from its registrar, as in the scaled-out form (the registrar is not called here); closed on the way out."""
    config = ConnectorConfig(engine_id=engine_id, role=role, control_plane="127.0.0.1:1", broker=seed, token="t", rpc_timeout_s=2.0)
    session = ControlSession(config, "test-shards")
    try:
        yield session
    finally:
        session.close()


class Answers:
    """Collects report answers from the control loop, by transfer id."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[object, errors.KvpushError | None]] = {}

    def for_(self, transfer_id: str):
        return lambda answer, error: self.items.__setitem__(transfer_id, (answer, error))


def registration(transfer_id: str, answers: Answers, **kwargs) -> Report:
    return Report("registrations", sample.destination_request(transfer_id), answers.for_(transfer_id), **kwargs)


async def sharded_map_applied(session: ControlSession, session_members: dict[str, StreamMember], method: str) -> None:
    """The session keeps streams to exactly these members, and each has the follower's one stream (the seed's is closed)."""
    await eventually(lambda: session.members() == set(session_members) and all(m.open_streams(method) == 1 for m in session_members.values()))


async def test_each_report_goes_on_its_transfers_owners_stream():
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b"]) as members:
        await cluster.publish(cluster.membership, revision=1)
        with session_on(members["a"].address) as session:
            reports = session.report_stream("decode-0")
            session.follow_members(EVENTS, lambda broker: broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest()),
                                   lambda member: lambda message: None)
            await sharded_map_applied(session, members, EVENTS)
            transfers = owned("a", cluster.membership, 10) + owned("b", cluster.membership, 10)
            answers = Answers()
            reports.send_many([registration(t, answers) for t in transfers])
            await eventually(lambda: len(answers.items) == len(transfers))
            assert all(error is None for _, error in answers.items.values())
            for member_id, member in members.items():
                assert sorted(t for _, t in member.accepted) == sorted(t for t in transfers if shards.owner(t, cluster.membership) == member_id)
                assert member.refused == []  # straight to the owner: no redirect


async def test_a_write_result_goes_to_the_member_whose_order_it_answers():
    """The transfer's owner is a, but b sent the order (the transfer moved to a since): b holds the attempt and takes the answer."""
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b"]) as members:
        await cluster.publish(cluster.membership, revision=1)
        with session_on(members["a"].address, "prefill-0", "prefill") as session:
            reports = session.report_stream("prefill-0")
            session.follow_members(ORDERS, lambda broker: broker.stream_write_orders(rv_pb.StreamWriteOrdersRequest()),
                                   lambda member: lambda message: None)
            await sharded_map_applied(session, members, ORDERS)
            t_a = owned("a", cluster.membership, 2)
            answers = Answers()
            reports.send_many([Report("write_results", sample.write_result_request(t_a[0]), answers.for_(t_a[0]), to="b"),
                               Report("write_results", sample.write_result_request(t_a[1]), answers.for_(t_a[1]), to="gone")])
            await eventually(lambda: len(answers.items) == 2)
            assert members["b"].accepted == [("write_results", t_a[0])]
            assert members["a"].accepted == [("write_results", t_a[1])]  # no stream to that member: the owner


async def test_a_report_refused_as_not_the_owners_goes_to_the_owner_the_refusal_names():
    """The engine's map lists a and b; c joined and the members know it: c's transfers reach a or b first, and are sent on to c."""
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b", "c"]) as members:
        lagging = {m: members[m].address for m in ("a", "b")}
        await cluster.publish(lagging, revision=1)
        with session_on(members["a"].address) as session:
            reports = session.report_stream("decode-0")
            session.follow_members(EVENTS, lambda broker: broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest()),
                                   lambda member: lambda message: None)
            await sharded_map_applied(session, {m: members[m] for m in lagging}, EVENTS)
            to_c = owned("c", cluster.membership, 6)
            answers = Answers()
            reports.send_many([registration(t, answers) for t in to_c + owned("a", cluster.membership, 3)])
            await eventually(lambda: len(answers.items) == 9)
            assert all(error is None for _, error in answers.items.values())
            assert sorted(t for _, t in members["c"].accepted) == sorted(to_c)
            assert sorted(t for _, t in members["a"].refused + members["b"].refused) == sorted(to_c)
            assert members["c"].open_streams(EVENTS) == 0  # c has the redirected reports' stream only, until the map lists it
            await cluster.publish(cluster.membership, revision=2)
            await eventually(lambda: members["c"].open_streams(EVENTS) == 1)
            more = owned("c", cluster.membership, 8)[6:]
            reports.send_many([registration(t, answers) for t in more])
            await eventually(lambda: len(answers.items) == 11)
            assert sorted(t for _, t in members["c"].accepted) == sorted(to_c + more)
            assert len(members["a"].refused + members["b"].refused) == len(to_c)  # now straight to c


async def test_a_refusal_naming_a_member_that_left_our_map_waits_for_the_answering_member_to_hear_of_it():
    """c died and left the engine's map; a and b have not heard yet and send c's transfers to c. The engine does not
    follow them to a member that is gone: it sends the item again by its own map once a and b caught up."""
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b", "c"]) as members:
        with_c = dict(cluster.membership)
        await cluster.publish(with_c, revision=1)
        with session_on(members["a"].address) as session:
            reports = session.report_stream("decode-0")
            session.follow_members(EVENTS, lambda broker: broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest()),
                                   lambda member: lambda message: None)
            await sharded_map_applied(session, members, EVENTS)
            await members["c"].server.stop(grace=None)
            without_c = {m: with_c[m] for m in ("a", "b")}
            await cluster.publish(without_c, revision=2)
            await eventually(lambda: session.members() == {"a", "b"})
            cluster.membership = with_c  # what a and b still believe
            (orphan,) = owned("c", with_c, 1)
            answers = Answers()
            reports.send(registration(orphan, answers))
            await eventually(lambda: any(t == orphan for _, t in members["a"].refused + members["b"].refused))
            await asyncio.sleep(0.2)
            assert orphan not in answers.items and session.members() == {"a", "b"}  # no stream opened to c
            cluster.membership = without_c  # a and b heard of it
            await eventually(lambda: orphan in answers.items)
            assert answers.items[orphan][1] is None, answers.items[orphan][1]
            new_owner = shards.owner(orphan, without_c)
            assert ("registrations", orphan) in members[new_owner].accepted


async def test_reports_sent_before_the_sharded_map_arrives_go_through_the_seed_and_on_to_their_owners():
    cluster = Cluster()
    cluster.answer_watches.clear()
    async with stream_members(cluster, ["a", "b"]) as members:
        await cluster.publish(cluster.membership, revision=1)
        with session_on(members["a"].address) as session:
            try:
                reports = session.report_stream("decode-0")
                transfers = owned("a", cluster.membership, 4) + owned("b", cluster.membership, 4)
                answers = Answers()
                reports.send_many([registration(t, answers) for t in transfers])
                await eventually(lambda: len(answers.items) == len(transfers))
                assert all(error is None for _, error in answers.items.values())
                assert sorted(t for _, t in members["b"].accepted) == sorted(transfers[4:])
                assert sorted(t for _, t in members["a"].refused) == sorted(transfers[4:])
            finally:
                cluster.answer_watches.set()


async def test_an_unsharded_broker_gets_todays_streams_at_once_and_no_more():
    cluster = Cluster()
    cluster.answer_watches.clear()  # the map never comes: nothing may wait for it
    async with stream_members(cluster, ["solo"]) as members:
        solo = members["solo"]
        with session_on(solo.address) as session:
            reports = session.report_stream("decode-0")
            session.follow_members(EVENTS, lambda broker: broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest()),
                                   lambda member: lambda message: None)
            answers, routed = Answers(), []
            reports.send_many([registration(f"t{n}", answers, on_route=routed.append) for n in range(5)])
            await eventually(lambda: len(answers.items) == 5)
            assert all(error is None for _, error in answers.items.values())
            # Open without the map. (Once, on a loaded CI machine, gRPC cancelled the first try under its
            # reader and the session opened it again 50 ms later: what counts is that one is open.)
            await eventually(lambda: solo.open_streams(EVENTS) == 1)
            opened = solo.streams_opened[EVENTS]
            assert solo.watches_open == 1
            cluster.answer_watches.set()  # the unsharded map: nothing changes, and the map is not followed any more
            await eventually(lambda: solo.watches_open == 0)
            assert solo.streams_opened[EVENTS] == opened and solo.open_streams(EVENTS) == 1
            reports.send(registration("t9", answers, on_route=routed.append))
            await eventually(lambda: len(answers.items) == 6)
            assert routed == []  # no owner tracking when there is nothing to lose
            assert solo.refused == []


@pytest.fixture
def producer_pair():
    """A prefill rank's Producer thread over real NIXL (tests/unit/nixl_pair), on the system clock."""
    with transfer_threads() as (pair, producer, _):
        yield pair, producer


async def test_a_lost_order_stream_stops_only_that_members_orders(producer_pair):
    pair, producer = producer_pair
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b"]) as members:
        await cluster.publish(cluster.membership, revision=1)
        with session_on(members["a"].address, "prefill-0", "prefill") as session:
            lost: list[str] = []

            def on_lost(member: str) -> None:
                producer.stream_lost(member)
                lost.append(member)

            session.follow_members(ORDERS, lambda broker: broker.stream_write_orders(rv_pb.StreamWriteOrdersRequest()), producer.open_stream, on_lost)
            await sharded_map_applied(session, members, ORDERS)
            opened_at_a = members["a"].streams_opened[ORDERS]
            t_a, t_b = owned("a", cluster.membership, 1)[0], owned("b", cluster.membership, 1)[0]
            members["a"].push(ORDERS, pair.message("order", t_a))
            members["b"].push(ORDERS, pair.message("order", t_b))
            await asyncio.sleep(0.2)  # both orders are in the producer's inbox
            await members["b"].server.stop(grace=None)
            await eventually(lambda: "b" in lost)
            for transfer_id in (t_a, t_b):
                producer.source_ready(SourceReady(f"p-{transfer_id}", transfer_id, 1, f"p-{transfer_id}", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
            await eventually(lambda: pair.reports)
            await asyncio.sleep(0.3)
            assert [(r.key.transfer_id, r.outcome) for r in pair.reports] == [(t_a, tr_pb.WRITE_OUTCOME_WRITTEN)]
            assert producer.has_work()  # t_b's source waits for a new order from its owner, its closure or its hold deadline
            assert members["a"].streams_opened[ORDERS] == opened_at_a and members["a"].open_streams(ORDERS) == 1  # a's stream lived on


async def test_a_member_leaving_the_map_fails_its_waiting_requests_and_keeps_their_blocks():
    """The decode scheduler's wiring (scheduler.py): routes and departures reach DecodeWaits through its inbox."""
    cluster = Cluster()
    async with stream_members(cluster, ["a", "b"]) as members:
        await cluster.publish(cluster.membership, revision=1)
        with session_on(members["a"].address) as session:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            left: list[str] = []

            def member_left(member: str, members_now: frozenset[str]) -> None:
                inbox.put(("member_left", member, members_now))
                left.append(member)

            session.on_member_left(member_left)
            clock = ManualClock()
            waits = DecodeWaits(clock, hold_margin_s=2.0)

            def drain() -> None:
                while not inbox.empty():
                    kind, *args = inbox.get()
                    waits.routed(*args) if kind == "routed" else waits.member_left(*args)

            reports = session.report_stream("decode-0")
            session.follow_members(EVENTS, lambda broker: broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest()),
                                   lambda member: lambda message: None)
            await sharded_map_applied(session, members, EVENTS)
            t_a, (t_b, t_b2) = owned("a", cluster.membership, 1)[0], owned("b", cluster.membership, 2)
            answers = Answers()
            for transfer_id in (t_a, t_b, t_b2):
                params = TransferParams("decode", transfer_id, 1, "prefill-0", None, "", "")
                waits.admit(f"d-{transfer_id}", params, "", timeout_s=10.0, alloc_ns=0)
                waits.registered(f"d-{transfer_id}")
            key = (t_b2, 1)
            reports.send_many([registration(t_a, answers, on_route=lambda m: inbox.put(("routed", (t_a, 1), m))),
                               registration(t_b, answers, on_route=lambda m: inbox.put(("routed", (t_b, 1), m)))])
            await eventually(lambda: len(answers.items) == 2)
            members["b"].hold_answers = True  # t_b2 reaches b and is never answered
            reports.send(registration(t_b2, answers, on_route=lambda m: inbox.put(("routed", key, m))))
            await eventually(lambda: members["b"].held)
            await cluster.publish({"a": members["a"].address}, revision=2)
            await eventually(lambda: t_b2 in answers.items)
            _, error = answers.items[t_b2]
            assert isinstance(error, errors.Unavailable) and error.reason == errors.Reason.BROKER_SHARD_LOST
            await eventually(lambda: left == ["b"])
            drain()
            for transfer_id in (t_b, t_b2):
                wait = waits.get(f"d-{transfer_id}")
                assert wait.member == "b" and "END_REASON_BROKER_SHARD_LOST" in wait.failure and not wait.safe
            assert not waits.get(f"d-{t_a}").failure
            # The new owner's word cannot free them: its orders never reached these blocks, the lost member's may have.
            waits.on_event(tr_pb.TransferEvent(key=tr_pb.TransferKey(transfer_id=t_b, attempt=1), type=tr_pb.TRANSFER_EVENT_TYPE_ENDED))
            assert waits.due() == ({}, [])  # held, and no cancellation to a member that never had them
            clock.advance(10.0 + 2.0)
            fails, cancels = waits.due()
            assert set(fails) == {f"d-{t_b}", f"d-{t_b2}", f"d-{t_a}"} and cancels == [(t_a, 1)]
            assert fails[f"d-{t_b}"].startswith("END_REASON_BROKER_SHARD_LOST")

