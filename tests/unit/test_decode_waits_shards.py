# SPDX-License-Identifier: Apache-2.0
"""DecodeWaits with a sharded broker: a member leaving fails the requests it owned, whose blocks wait for the hold rule."""

from __future__ import annotations

from kvpush import shards
from kvpush.clock import ManualClock
from kvpush.connector.decode_waits import DecodeWaits
from kvpush.connector.params import TransferParams
from kvpush.rendezvous.v1 import transfer_pb2

TIMEOUT_S, HOLD_S = 10.0, 2.0


def waiting(clock: ManualClock, *transfer_ids: str) -> DecodeWaits:
    waits = DecodeWaits(clock, HOLD_S)
    for transfer_id in transfer_ids:
        waits.admit(f"d-{transfer_id}", TransferParams("decode", transfer_id, 1, "prefill-0", None, "", ""), "", TIMEOUT_S, 0)
        waits.registered(f"d-{transfer_id}")
    return waits


def test_a_departed_members_requests_fail_at_once_and_free_their_blocks_only_by_the_hold_rule(clock: ManualClock):
    waits = waiting(clock, "t1", "t2")
    waits.routed(("t1", 1), "a")
    waits.routed(("t2", 1), "b")
    waits.member_left("b", frozenset({"a"}))
    assert waits.due() == ({}, [])  # failed, held, and no cancellation: the new owner cannot fence b's orders
    assert waits.get("d-t2").failure.startswith("END_REASON_BROKER_SHARD_LOST") and not waits.get("d-t1").failure
    waits.on_event(transfer_pb2.TransferEvent(key=transfer_pb2.TransferKey(transfer_id="t2", attempt=1), type=transfer_pb2.TRANSFER_EVENT_TYPE_ENDED))
    waits.registration_refused(("t2", 1), "unknown attempt", fenced=True)
    waits.registration_answered(("t2", 1), transfer_pb2.TRANSFER_STATE_CANCELLED, fenced=True)
    assert waits.due() == ({}, [])
    clock.advance(TIMEOUT_S + HOLD_S)
    fails, cancels = waits.due()
    assert fails["d-t2"].startswith("END_REASON_BROKER_SHARD_LOST") and cancels == [("t1", 1)]


def test_a_request_that_received_its_kv_before_the_member_left_decodes(clock: ManualClock):
    waits = waiting(clock, "t1")
    waits.routed(("t1", 1), "b")
    assert waits.received("d-t1") is not None
    waits.member_left("b", frozenset({"a"}))
    assert len(waits) == 0 and waits.due() == ({}, [])


def test_a_request_moved_to_another_member_before_it_left_is_not_failed(clock: ManualClock):
    """Its registration went to b, then (never sent to b, or redirected) to a: b leaving does not concern it."""
    waits = waiting(clock, "t1")
    waits.routed(("t1", 1), "b")
    waits.routed(("t1", 1), "a")
    waits.member_left("b", frozenset({"a"}))
    assert not waits.get("d-t1").failure


def test_a_request_registered_through_the_seed_belongs_to_the_member_it_hashed_to(clock: ManualClock):
    """Registered before the sharded map arrived (no route recorded): the seed answered it only as its owner."""
    members = frozenset({"a", "b", "c"})
    to_b = next(t for t in (f"t{n}" for n in range(100)) if shards.owner(t, members) == "b")
    to_a = next(t for t in (f"t{n}" for n in range(100)) if shards.owner(t, members) == "a")
    waits = waiting(clock, to_a, to_b)
    waits.member_left("b", members - {"b"})
    assert waits.get(f"d-{to_b}").failure.startswith("END_REASON_BROKER_SHARD_LOST")
    assert not waits.get(f"d-{to_a}").failure and waits.get(f"d-{to_a}").member == "a"


def test_a_request_not_registered_yet_is_not_failed_by_a_departure(clock: ManualClock):
    waits = DecodeWaits(clock, HOLD_S)
    waits.admit("d-t1", TransferParams("decode", "t1", 1, "prefill-0", None, "", ""), "", TIMEOUT_S, 0)
    waits.member_left("b", frozenset())
    assert not waits.get("d-t1").failure
