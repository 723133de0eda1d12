# SPDX-License-Identifier: Apache-2.0
"""The rendezvous over real gRPC: orders on StreamWriteOrders, events on StreamTransferEvents."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import CALL_TIMEOUT_S, WAIT_S, FakeEngine, Inbox, bearer, expect_rpc_error, read

from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common import sample_engines as sample

T = CALL_TIMEOUT_S


def written(transfer_id: str, attempt: int = 1, outcome: int = tr_pb.WRITE_OUTCOME_WRITTEN) -> rv_pb.ReportWriteResultRequest:
    return sample.write_result_request(transfer_id, attempt, outcome=outcome)


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

    message = await read(orders)
    assert message.order.key.transfer_id == "t1" and message.order.HasField("source")
    assert list(message.order.decode_tp_ranks) == [0]
    result = await prefill.broker.ReportWriteResult(written("t1"), metadata=prefill.metadata, timeout=T)
    assert result.state == tr_pb.TRANSFER_STATE_DONE
    event = (await read(events)).event
    assert (event.key.transfer_id, event.type, event.state) == ("t1", tr_pb.TRANSFER_EVENT_TYPE_COMPLETED, tr_pb.TRANSFER_STATE_DONE)
    assert (await read(orders)).closed.state == tr_pb.TRANSFER_STATE_DONE
    transfer = (await decode.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=bearer(), timeout=T)).transfer
    assert transfer.fenced and transfer.bytes_written == 4096
    orders.cancel()
    events.cancel()


async def test_early_orders_arrive_at_registration(engines):
    prefill, decode = engines
    orders = await prefill.orders(early=True)
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    message = await read(orders)
    assert not message.order.HasField("source")
    assert message.order.write_budget.ToNanoseconds() > 0
    orders.cancel()


async def test_orders_wait_for_a_rank_that_subscribes_late(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    orders = await prefill.orders()
    assert (await read(orders)).order.key.transfer_id == "t1"
    orders.cancel()


async def test_reissue_supersedes_and_fences_before_decode_is_told(engines):
    prefill, decode = engines
    orders = await prefill.orders()
    events = Inbox(await decode.events())
    await decode.broker.RegisterDestination(sample.destination_request("t1", 1), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", 1), metadata=prefill.metadata, timeout=T)
    assert (await read(orders)).order.key.attempt == 1
    await decode.broker.RegisterDestination(sample.destination_request("t1", 2, first_block=8), metadata=decode.metadata, timeout=T)
    revocation = (await read(orders)).revocation
    assert (revocation.key.attempt, revocation.reason) == (1, tr_pb.END_REASON_SUPERSEDED)
    assert (await read(orders)).closed.key.attempt == 1
    await expect_rpc_error(
        prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", 1), metadata=prefill.metadata, timeout=T),
        grpc.StatusCode.ABORTED,
        Reason.TRANSFER_SUPERSEDED,
        "key.attempt",
    )
    assert await events.nothing_for(0.3)  # attempt 1's order is unanswered: no ENDED yet
    await prefill.broker.ReportWriteResult(written("t1", 1, tr_pb.WRITE_OUTCOME_REVOKED), metadata=prefill.metadata, timeout=T)
    event = (await events.next()).event
    assert (event.key.attempt, event.type, event.reason) == (1, tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_SUPERSEDED)
    orders.cancel()
    await events.close()


async def test_router_cancel(engines):
    prefill, decode = engines
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    router = rv_grpc.RendezvousServiceStub(decode.channel)
    key = tr_pb.TransferKey(transfer_id="t1", attempt=0)
    response = await router.CancelTransfer(rv_pb.CancelTransferRequest(key=key, detail="client left"), metadata=bearer(), timeout=T)
    assert response.state == tr_pb.TRANSFER_STATE_CANCELLED
    event = (await read(events)).event
    assert (event.type, event.reason, event.detail) == (tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_CANCELLED_BY_ROUTER, "client left")
    events.cancel()


async def test_an_engine_cancel_is_attributed_to_its_role(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    key = tr_pb.TransferKey(transfer_id="t1", attempt=1)
    await prefill.broker.CancelTransfer(rv_pb.CancelTransferRequest(key=key), metadata=prefill.metadata, timeout=T)
    transfer = (await prefill.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1", attempt=1), metadata=bearer(), timeout=T)).transfer
    assert transfer.end_reason == tr_pb.END_REASON_CANCELLED_BY_PREFILL


async def test_a_deadline_ends_the_attempt_on_time(engines):
    prefill, decode = engines
    events = await decode.events()
    started = time.monotonic()
    await decode.broker.RegisterDestination(sample.destination_request("t1", timeout_s=0.3), metadata=decode.metadata, timeout=T)
    event = (await read(events)).event
    waited = time.monotonic() - started
    assert event.reason == tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED
    assert 0.29 <= waited < 2.0  # at the deadline, not at some polling interval
    events.cancel()


async def test_closing_the_keepalive_stream_loses_the_engine_and_tells_decode(engines):
    prefill, decode = engines
    keep_alive = await prefill.keep_alive()
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    started = time.monotonic()
    keep_alive.cancel()
    event = (await read(events)).event
    assert (event.type, event.reason) == (tr_pb.TRANSFER_EVENT_TYPE_ENDED, tr_pb.END_REASON_PREFILL_ENGINE_LOST)
    assert time.monotonic() - started < 5.0  # well within the 5 s lease
    await expect_rpc_error(
        prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T),
        grpc.StatusCode.PERMISSION_DENIED,
        Reason.ENGINE_IDENTITY_MISMATCH,
        "source.engine_id",
    )
    events.cancel()


async def test_a_lapsed_lease_loses_the_engine(channel):
    await FakeEngine(channel, "prefill-0", sample.PREFILL).register(lease_ttl_s=1.0)
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register(lease_ttl_s=30.0)
    events = await decode.events()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    event = (await read(events, timeout=3.0)).event
    assert event.reason == tr_pb.END_REASON_PREFILL_ENGINE_LOST
    assert "LEASE_EXPIRED" in event.detail
    events.cancel()


async def test_a_second_orders_stream_replaces_the_first(engines):
    prefill, decode = engines
    first = await prefill.orders()
    second = await prefill.orders()
    assert await asyncio.wait_for(first.read(), WAIT_S) is grpc.aio.EOF
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    assert (await read(second)).order.key.transfer_id == "t1"
    second.cancel()


async def test_the_callers_trace_context_reaches_the_producer(engines):
    prefill, decode = engines
    orders = await prefill.orders()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=(*decode.metadata, ("traceparent", traceparent)), timeout=T)
    await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
    order = (await read(orders)).order
    assert order.trace_context["traceparent"].split("-")[1] == trace_id
    orders.cancel()
