# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: validation of destinations, block lists, prefill-done and subscriptions, with exact reasons and fields."""

from __future__ import annotations

import pytest
from broker_harness import (
    ENDED,
    FAILED_EVENT,
    REVOKED,
    D,
    Harness,
    P,
    S,
    expect,
)

from kvpush import errors
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

# ----- validation -----


def _bad(**kwargs):
    return kwargs


DESTINATION_ERRORS = [
    ("block id out of range", _bad(first_block=998), errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]"),
    ("first token not on a block boundary", _bad(first_token=8), errors.InvalidArgument, Reason.FIELD_INVALID, "destination.first_token"),
    ("no tokens", _bad(num_tokens=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "destination.num_tokens"),
    ("unknown prefill engine", _bad(prefill_engine_id="prefill-9"), errors.NotFound, Reason.ENGINE_NOT_FOUND, "prefill_engine_id"),
    ("prefill engine is a decode engine", _bad(prefill_engine_id="decode-1"), errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "prefill_engine_id"),
    ("incompatible prefill engine", _bad(prefill_engine_id="prefill-x"), errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "prefill_engine_id"),
    ("prefill engine not ready", _bad(prefill_engine_id="prefill-half"), errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "prefill_engine_id"),
    ("old decode incarnation", _bad(incarnation="inc-0"), errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "destination.incarnation"),
    ("caller is another engine", _bad(decode_engine_id="decode-1"), errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "destination.engine_id"),
    ("bad transfer id", _bad(transfer_id="t 1"), errors.InvalidArgument, Reason.FIELD_INVALID, "key.transfer_id"),
    ("attempt 0", _bad(attempt=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "key.attempt"),
    ("no timeout", _bad(timeout_s=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "timeout"),
    ("timeout too long", _bad(timeout_s=601), errors.InvalidArgument, Reason.FIELD_OUT_OF_RANGE, "timeout"),
]


@pytest.fixture
def crowded() -> Harness:
    h = Harness()
    h.registrar.register(sample.rank_request("decode-1", sample.DECODE))
    h.registrar.register(sample.rank_request("prefill-x", sample.PREFILL, compatibility_hash="other-model"))
    h.registrar.register(sample.rank_request("prefill-half", sample.PREFILL, tp_size=2))
    return h


@pytest.mark.parametrize("change, error_type, reason, field", [c[1:] for c in DESTINATION_ERRORS], ids=[c[0] for c in DESTINATION_ERRORS])
def test_bad_destinations(crowded: Harness, change, error_type, reason, field):
    transfer_id = change.pop("transfer_id", "t1")
    attempt = change.pop("attempt", 1)
    request = sample.destination_request(transfer_id, attempt, **change)
    error = expect(error_type, reason, field, crowded.broker.register_destination, request, D)
    assert error.metadata["fenced"] == "true"  # no WRITE can land in the blocks it named
    assert crowded.broker.live_attempts == 0


def test_bad_block_lists():
    h = Harness()  # each refused registration is remembered (a tombstone), so each uses its own transfer
    request = sample.destination_request("t1")
    request.destination.blocks[0].group_index = 3
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].group_index", h.broker.register_destination, request, D)
    request = sample.destination_request("t2")
    del request.destination.blocks[0].block_ids[-1]
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].block_ids", h.broker.register_destination, request, D)
    request = sample.destination_request("t3")
    del request.destination.blocks[:]
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "destination.blocks", h.broker.register_destination, request, D)
    request = sample.prefill_done_request("t4", first_block=999)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "source.blocks[0].block_ids[1]", h.broker.report_prefill_done, request, P)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t4")  # a refused prefill-done leaves nothing


def test_prefill_done_validation(crowded: Harness):
    broker = crowded.broker
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "source.engine_id", broker.report_prefill_done, sample.prefill_done_request("t1"), "prefill-x")
    expect(errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "decode_engine_id", crowded.prefill_done, decode_engine_id="prefill-x")
    expect(errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "source.incarnation", crowded.prefill_done, incarnation="inc-7")
    request = sample.prefill_done_request("t1", prefill_engine_id="prefill-x", decode_engine_id=D)
    expect(errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "decode_engine_id", broker.report_prefill_done, request, "prefill-x")
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "source", broker.report_prefill_done, rv_pb.ReportPrefillDoneRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1)), P)


def test_the_two_sides_must_name_each_other(crowded: Harness):
    crowded.prefill_done(decode_engine_id="decode-1")
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.engine_id", crowded.register)
    crowded.register("t2")
    request = sample.prefill_done_request("t2", prefill_engine_id="prefill-half")
    expect(errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "source.engine_id", crowded.broker.report_prefill_done, request, "prefill-half")
    crowded.registrar.register(sample.rank_request("prefill-half", sample.PREFILL, tp_rank=1, tp_size=2))
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "source.engine_id", crowded.broker.report_prefill_done, request, "prefill-half")
    assert crowded.state("t2") == S.TRANSFER_STATE_WAITING_FOR_PREFILL


def test_too_few_prefill_tokens_fail_the_attempt_and_tell_both_sides():
    h = Harness(early=True)
    h.register(num_tokens=40)
    assert h.kinds() == [("order", "t1", 1)]
    error = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "source.num_tokens", h.prefill_done, num_tokens=32)
    expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "source.num_tokens", h.prefill_done, num_tokens=32)  # same answer again
    assert "40" in error.message
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_TOKEN_COUNT_MISMATCH)
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_TOKEN_COUNT_MISMATCH)]
    h.write(outcome=REVOKED)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_registration_wanting_more_tokens_than_prefill_computed_fails_the_attempt():
    h = Harness(early=False)
    h.prefill_done(num_tokens=32)
    error = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "destination.num_tokens", h.register, num_tokens=40)
    assert "32" in error.message and "40" in error.message
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_TOKEN_COUNT_MISMATCH)
    assert ("order", "t1", 1) not in h.kinds()
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_partially_cached_destination_needs_only_its_tail():
    h = Harness()
    h.prefill_done(num_tokens=40)
    response = h.register(first_token=16, num_tokens=24)
    assert response.state == S.TRANSFER_STATE_MATCHED
    [message] = h.messages()
    assert list(message.order.destination.blocks[0].block_ids) == [0, 1]


def test_subscriptions_are_validated():
    h = Harness()
    broker = h.broker
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "engine_id", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation="inc-1"), D)
    expect(errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "engine_id", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=D, incarnation="inc-1"), D)
    expect(errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "incarnation", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="x"), D)
    expect(errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "tp_rank", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation="inc-1", tp_rank=3), P)
    expect(errors.NotFound, Reason.ENGINE_NOT_FOUND, "engine_id", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id="decode-9", incarnation="x"), "decode-9")
    broker.close()
    assert not h.producers[0].active
    expect(errors.Unavailable, Reason.UNAVAILABLE, "", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1"), D)
