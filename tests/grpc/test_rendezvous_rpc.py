# SPDX-License-Identifier: Apache-2.0
"""The rendezvous over real gRPC: orders on StreamWriteOrders, events on StreamTransferEvents, GetTransfer's long poll.

The control plane here runs with short fencing timings (a stream lease of
0.3 s, so heartbeats every 0.1 s and a startup grace of 0.45 s), and every
test starts once that grace is over: a broker fences nothing with orders or
a destination before.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from rpc_harness import CALL_TIMEOUT_S, WAIT_S, FakeEngine, Inbox, bearer, expect_rpc_error, read, running_control_plane

from kvpush import status
from kvpush.clock import duration
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common.config import ServerConfig

T = CALL_TIMEOUT_S
BROKER_CONFIG = BrokerConfig(max_clock_skew_s=0.05, stream_lease_s=0.3, write_timeout_s=0.1, fence_margin_s=0.05)
# How long after its stream went away a lost producer rank's unanswered order is fenced.
LOST_RANK_FENCE_S = BROKER_CONFIG.stream_lease_s + BROKER_CONFIG.write_timeout_s + BROKER_CONFIG.fence_margin_s


@pytest.fixture
async def plane():
    """This module's control plane: short fencing timings, and its startup grace already over."""
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), broker_config=BROKER_CONFIG) as started:
        await asyncio.sleep(BROKER_CONFIG.startup_grace_s)
        yield started


def written(transfer_id: str, attempt: int = 1, outcome: int = tr_pb.WRITE_OUTCOME_WRITTEN) -> rv_pb.ReportWriteResultRequest:
    return sample.write_result_request(transfer_id, attempt, outcome=outcome)


async def next_message(orders, timeout: float = WAIT_S) -> rv_pb.StreamWriteOrdersResponse:
    """The next order, revocation or closure on a StreamWriteOrders stream (heartbeats skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        message = await read(orders, max(deadline - time.monotonic(), 0.001))
        if message.WhichOneof("message") != "heartbeat":
            return message


def get_transfer(engine: FakeEngine, transfer_id: str, attempt: int = 0, wait_s: float | None = None, timeout: float = T):
    request = rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt)
    if wait_s is not None:
        request.wait.CopyFrom(duration(wait_s))
    return rv_grpc.RendezvousServiceStub(engine.channel).GetTransfer(request, metadata=bearer(), timeout=timeout)


async def cancel(engine: FakeEngine, transfer_id: str, attempt: int = 0, detail: str = "") -> rv_pb.CancelTransferResponse:
    key = tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt)
    return await rv_grpc.RendezvousServiceStub(engine.channel).CancelTransfer(
        rv_pb.CancelTransferRequest(key=key, detail=detail), metadata=bearer(), timeout=T
    )


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode first", "prefill first"])
async def test_rendezvous_in_either_order(engines, decode_first):
    prefill, decode = engines
    orders = await prefill.orders()
    events = await decode.events()

    def register():  # a grpc.aio call starts when created, so each is created when due
        return decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)

    def report():
        return prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)

    first, second = (register, report) if decode_first else (report, register)
    first_response = await first()
    assert first_response.state in (tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL, tr_pb.TRANSFER_STATE_WAITING_FOR_REGISTRATION)
    second_response = await second()
    assert second_response.state == tr_pb.TRANSFER_STATE_MATCHED
    assert second_response.first_arrival == (tr_pb.TRANSFER_SIDE_DECODE if decode_first else tr_pb.TRANSFER_SIDE_PREFILL)

    message = await next_message(orders)
    assert message.order.key.transfer_id == "t1" and message.order.HasField("source")
    assert list(message.order.decode_tp_ranks) == [0]
    assert message.order.write_timeout.ToNanoseconds() == int(BROKER_CONFIG.write_timeout_s * 1e9)
    result = await prefill.broker.ReportWriteResult(written("t1"), metadata=prefill.metadata, timeout=T)
    assert result.state == tr_pb.TRANSFER_STATE_DONE
    event = (await read(events)).event
    assert (event.key.transfer_id, event.type, event.state) == ("t1", tr_pb.TRANSFER_EVENT_TYPE_COMPLETED, tr_pb.TRANSFER_STATE_DONE)
    transfer = (await get_transfer(decode, "t1")).transfer
    assert transfer.fenced and transfer.bytes_written == 4096
    # The rank that wrote gets no closure for t1: the next message on its stream is t2's order.
    await decode.broker.RegisterDestination(sample.destination_request("t2", first_block=8), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t2", first_block=8), metadata=prefill.metadata, timeout=T)
    assert (await next_message(orders)).order.key.transfer_id == "t2"
    orders.cancel()
    events.cancel()


async def test_a_decode_engine_that_asks_for_failures_only_gets_no_completed_event(engines):
    """D's scheduler streams FAILED and ENDED only (its workers count the WRITEs' notifications): t1's completion is not sent."""
    prefill, decode = engines
    request = rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1",
                                                event_types=(tr_pb.TRANSFER_EVENT_TYPE_FAILED, tr_pb.TRANSFER_EVENT_TYPE_ENDED))
    events = decode.broker.StreamTransferEvents(request, metadata=decode.metadata, timeout=T)
    await asyncio.wait_for(events.initial_metadata(), WAIT_S)
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert (await prefill.broker.ReportWriteResult(written("t1"), metadata=prefill.metadata, timeout=T)).state == tr_pb.TRANSFER_STATE_DONE
    await decode.broker.RegisterDestination(sample.destination_request("t2", first_block=8), metadata=decode.metadata, timeout=T)
    await cancel(decode, "t2", 0, "client left")
    event = (await read(events)).event
    assert (event.key.transfer_id, event.type) == ("t2", tr_pb.TRANSFER_EVENT_TYPE_ENDED)
    events.cancel()
    # An unknown type is refused with its field.
    request.event_types.append(99)
    refused = decode.broker.StreamTransferEvents(request, metadata=decode.metadata, timeout=T)
    await expect_rpc_error(refused.read(), grpc.StatusCode.INVALID_ARGUMENT, "FIELD_INVALID", "event_types")


async def test_early_orders_arrive_at_registration(engines):
    prefill, decode = engines
    orders = await prefill.orders(early=True)
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    message = await next_message(orders)
    assert not message.order.HasField("source")
    assert message.order.write_budget.ToNanoseconds() > 0
    orders.cancel()


async def test_orders_wait_for_a_rank_that_subscribes_late(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    orders = await prefill.orders()
    assert (await next_message(orders)).order.key.transfer_id == "t1"
    orders.cancel()


async def test_reissue_supersedes_and_decode_is_told_failed_then_ended_once_fenced(engines):
    prefill, decode = engines
    orders = await prefill.orders()
    events = Inbox(await decode.events())
    await decode.broker.RegisterDestination(sample.destination_request("t1", 1), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", 1), metadata=prefill.metadata, timeout=T)
    assert (await next_message(orders)).order.key.attempt == 1
    await decode.broker.RegisterDestination(sample.destination_request("t1", 2, first_block=8), metadata=decode.metadata, timeout=T)
    revocation = (await next_message(orders)).revocation
    assert (revocation.key.attempt, revocation.reason) == (1, tr_pb.END_REASON_SUPERSEDED)
    assert (await next_message(orders)).closed.key.attempt == 1
    # Attempt 1's order is unanswered: a WRITE may still land, so FAILED (hold the blocks), not ENDED.
    event = (await events.next()).event
    assert (event.key.attempt, event.type, event.reason) == (1, tr_pb.TRANSFER_EVENT_TYPE_FAILED, tr_pb.END_REASON_SUPERSEDED)
    # An identical repeat answers attempt 1's state; other content is refused.
    repeat = await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", 1), metadata=prefill.metadata, timeout=T)
    assert repeat.state == tr_pb.TRANSFER_STATE_SUPERSEDED
    await expect_rpc_error(
        prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", 1, num_tokens=48), metadata=prefill.metadata, timeout=T),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.TRANSFER_ENDED,
        "key",
    )
    assert await events.nothing_for(0.3)  # attempt 1's rank is attached and has budget left: no ENDED by time
    await prefill.broker.ReportWriteResult(written("t1", 1, tr_pb.WRITE_OUTCOME_REVOKED), metadata=prefill.metadata, timeout=T)
    event = (await events.next()).event
    assert (event.key.attempt, event.type, event.reason) == (1, tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_SUPERSEDED)
    repeat = await decode.broker.RegisterDestination(sample.destination_request("t1", 1), metadata=decode.metadata, timeout=T)
    assert (repeat.state, repeat.fenced) == (tr_pb.TRANSFER_STATE_SUPERSEDED, True)
    orders.cancel()
    await events.close()


async def test_router_cancel(engines):
    prefill, decode = engines
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    response = await cancel(decode, "t1", 0, "client left")
    assert (response.state, response.fenced) == (tr_pb.TRANSFER_STATE_CANCELLED, True)  # nothing was ordered
    event = (await read(events)).event
    assert (event.type, event.reason, event.detail) == (
        tr_pb.TRANSFER_EVENT_TYPE_ENDED,
        tr_pb.END_REASON_CANCELLED_BY_ROUTER,
        "client left",
    )
    events.cancel()


async def test_an_engine_cancel_is_attributed_to_its_role(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    key = tr_pb.TransferKey(transfer_id="t1", attempt=1)
    await prefill.broker.CancelTransfer(rv_pb.CancelTransferRequest(key=key), metadata=prefill.metadata, timeout=T)
    transfer = (await get_transfer(prefill, "t1", 1)).transfer
    assert transfer.end_reason == tr_pb.END_REASON_CANCELLED_BY_PREFILL


async def test_a_deadline_ends_the_attempt_on_time(engines):
    prefill, decode = engines
    events = await decode.events()
    started = time.monotonic()
    await decode.broker.RegisterDestination(sample.destination_request("t1", timeout_s=0.3), metadata=decode.metadata, timeout=T)
    event = (await read(events)).event
    waited = time.monotonic() - started
    assert (event.type, event.reason) == (tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)
    assert 0.29 <= waited < 2.0  # at the deadline, not at some polling interval
    events.cancel()


async def test_a_refused_registration_says_whether_its_blocks_are_fenced(engines):
    prefill, decode = engines
    request = sample.destination_request("t1", first_block=998)
    error = await expect_rpc_error(
        decode.broker.RegisterDestination(request, metadata=decode.metadata, timeout=T),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.BLOCK_ID_OUT_OF_RANGE,
        "destination.blocks[0].block_ids[2]",
    )
    assert status.error_info(error).metadata["fenced"] == "true"
    late = await expect_rpc_error(
        decode.broker.RegisterDestination(request, metadata=decode.metadata, timeout=T),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.TRANSFER_ENDED,
        "key",
    )
    assert status.error_info(late).metadata["fenced"] == "true"
    transfer = (await get_transfer(decode, "t1", 1)).transfer
    assert (transfer.state, transfer.end_reason) == (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_REGISTRATION_REFUSED)


async def test_closing_the_keepalive_stream_does_not_end_the_lease(engines):
    prefill, decode = engines
    keep_alive = await prefill.keep_alive()
    events = Inbox(await decode.events())
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    keep_alive.cancel()
    assert await events.nothing_for(0.5)  # the engine is not lost: its lease lapses only by time
    response = await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert response.state == tr_pb.TRANSFER_STATE_MATCHED
    keep_alive = await prefill.keep_alive()  # a reconnecting rank renews the same lease
    keep_alive.cancel()
    await events.close()


async def test_a_lapsed_lease_loses_the_engine(channel):
    await FakeEngine(channel, "prefill-0", sample.PREFILL).register(lease_ttl_s=1.0)
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register(lease_ttl_s=30.0)
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    event = (await read(events, timeout=3.0)).event
    assert (event.type, event.reason) == (tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_PREFILL_ENGINE_LOST)  # nothing was ordered
    assert "LEASE_EXPIRED" in event.detail
    events.cancel()


async def test_a_lost_producer_with_an_unanswered_order_is_failed_at_once_and_ended_by_time(channel):
    prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register(lease_ttl_s=1.0)
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register(lease_ttl_s=30.0)
    orders = await prefill.orders()
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert (await next_message(orders)).order.key.transfer_id == "t1"
    failed = (await read(events, timeout=3.0)).event
    assert (failed.type, failed.reason) == (tr_pb.TRANSFER_EVENT_TYPE_FAILED, tr_pb.END_REASON_PREFILL_ENGINE_LOST)
    # The lost rank might still post until its stream lease ran out, and that WRITE might take write_timeout.
    ended = (await read(events, timeout=3.0)).event
    assert (ended.type, ended.reason) == (tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_PREFILL_ENGINE_LOST)
    transfer = (await get_transfer(decode, "t1", 1)).transfer
    assert transfer.fenced
    when = {entry.kind: entry.time.ToNanoseconds() / 1e9 for entry in transfer.timeline}
    assert (
        LOST_RANK_FENCE_S - 0.01 <= when[tr_pb.TIMELINE_ENTRY_KIND_FENCED] - when[tr_pb.TIMELINE_ENTRY_KIND_ENDED] < LOST_RANK_FENCE_S + 1.0
    )
    orders.cancel()
    events.cancel()


async def test_a_second_orders_stream_replaces_the_first(engines):
    prefill, decode = engines
    first = await prefill.orders()
    second = await prefill.orders()
    while (message := await asyncio.wait_for(first.read(), WAIT_S)) is not grpc.aio.EOF:
        assert message.WhichOneof("message") == "heartbeat"
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert (await next_message(second)).order.key.transfer_id == "t1"
    second.cancel()


async def test_a_quiet_orders_stream_gets_heartbeats_that_renew_the_stream_lease(engines):
    prefill, decode = engines
    orders = await prefill.orders()
    interval = BROKER_CONFIG.stream_lease_s / 3
    first = await read(orders, timeout=2.0)
    second = await read(orders, timeout=2.0)
    assert first.WhichOneof("message") == second.WhichOneof("message") == "heartbeat"
    gap = (second.send_time.ToNanoseconds() - first.send_time.ToNanoseconds()) / 1e9
    assert interval - 0.01 <= gap < 1.0  # one each quiet interval (the lease is 0.25 s; the bound allows a loaded test host)
    lease_ns = int((BROKER_CONFIG.stream_lease_s - BROKER_CONFIG.max_clock_skew_s) * 1e9)
    for heartbeat in (first, second):
        assert heartbeat.stream_lease.ToNanoseconds() == pytest.approx(lease_ns, abs=1000)
        assert abs(heartbeat.send_time.ToNanoseconds() / 1e9 - time.time()) < 2.0
    # Orders still flow between heartbeats.
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert (await next_message(orders)).order.key.transfer_id == "t1"
    orders.cancel()


async def test_a_decode_events_stream_gets_no_heartbeats(engines):
    prefill, decode = engines
    events = Inbox(await decode.events())
    assert await events.nothing_for(3 * BROKER_CONFIG.stream_lease_s)
    await events.close()


async def test_the_callers_trace_context_reaches_the_producer(engines):
    prefill, decode = engines
    orders = await prefill.orders()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    await decode.broker.RegisterDestination(
        sample.destination_request("t1"), metadata=(*decode.metadata, ("traceparent", traceparent)), timeout=T
    )
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    order = (await next_message(orders)).order
    assert order.trace_context["traceparent"].split("-")[1] == trace_id
    orders.cancel()


# ----- GetTransfer's long poll -----


async def test_get_transfer_with_wait_returns_when_the_attempt_ends(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    started = time.monotonic()
    poll = asyncio.ensure_future(get_transfer(decode, "t1", 1, wait_s=4.0))
    newest = asyncio.ensure_future(get_transfer(decode, "t1", 0, wait_s=4.0))  # attempt 0: the newest attempt
    await asyncio.sleep(0.3)
    assert not poll.done() and not newest.done()
    await cancel(decode, "t1", 1, "client left")
    for call in (poll, newest):
        transfer = (await asyncio.wait_for(call, WAIT_S)).transfer
        assert (transfer.key.attempt, transfer.state, transfer.end_reason) == (
            1,
            tr_pb.TRANSFER_STATE_CANCELLED,
            tr_pb.END_REASON_CANCELLED_BY_ROUTER,
        )
    assert 0.3 <= time.monotonic() - started < 2.0  # at the end, not at the end of the wait


async def test_get_transfer_with_wait_returns_the_live_state_once_the_wait_passed(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    started = time.monotonic()
    transfer = (await get_transfer(decode, "t1", 1, wait_s=0.5)).transfer
    assert 0.49 <= time.monotonic() - started < 2.0
    assert transfer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
    # A caller's deadline shorter than the wait: the answer comes just before it (not DEADLINE_EXCEEDED).
    started = time.monotonic()
    transfer = (await get_transfer(decode, "t1", 1, wait_s=10.0, timeout=1.0)).transfer
    assert transfer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL and 0.9 <= time.monotonic() - started < 1.0


async def test_get_transfer_with_wait_answers_an_ended_attempt_at_once(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await cancel(decode, "t1", 1)
    started = time.monotonic()
    transfer = (await get_transfer(decode, "t1", 1, wait_s=4.0)).transfer
    assert transfer.state == tr_pb.TRANSFER_STATE_CANCELLED and time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "transfer_id, attempt, field", [("t9", 1, "transfer_id"), ("t1", 5, "attempt")], ids=["unknown transfer", "unknown attempt"]
)
async def test_get_transfer_with_wait_refuses_an_unknown_attempt_at_once(engines, transfer_id, attempt, field):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    started = time.monotonic()
    await expect_rpc_error(
        get_transfer(decode, transfer_id, attempt, wait_s=4.0), grpc.StatusCode.NOT_FOUND, Reason.TRANSFER_NOT_FOUND, field
    )
    assert time.monotonic() - started < 1.0


async def test_get_transfer_refuses_a_wait_longer_than_the_broker_honours(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await expect_rpc_error(get_transfer(decode, "t1", 1, wait_s=601.0), grpc.StatusCode.INVALID_ARGUMENT, Reason.FIELD_OUT_OF_RANGE, "wait")


async def test_an_unsharded_broker_maps_one_shard_at_the_address_called_and_keeps_the_stream_open(channel):
    call = rv_grpc.RendezvousServiceStub(channel).WatchShards(rv_pb.WatchShardsRequest(), metadata=bearer("decode-0"), timeout=T)
    assert await read(call) == rv_pb.WatchShardsResponse(shards=[rv_pb.BrokerShard(member_id="", address="")], revision=0)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(call.read(), 0.3)  # nothing more: the map never changes
    call.cancel()
