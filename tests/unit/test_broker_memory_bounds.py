# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: memory bounds: settled attempts age out, caps, every table shrinks back."""

from __future__ import annotations

from broker_harness import (
    REVOKED,
    D,
    Harness,
    S,
    expect,
)

from kvpush import errors
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.config import BrokerConfig

# ----- memory bounds -----


def test_settled_attempts_age_out_after_retention_and_their_registrations_deadline():
    h = Harness(config=BrokerConfig(retention_s=10.0))
    h.register(attempt=1)  # deadline: now + 30
    h.register(attempt=2, timeout_s=100)  # supersedes attempt 1, which settles at once
    assert h.broker.tick() == h.clock.now() + 30  # kept past retention until its registration's deadline
    h.advance(10)
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    h.advance(20)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "attempt", h.broker.get_transfer, "t1", 1)
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=1)  # the newest attempt still refuses it
    h.prefill_done(attempt=2)
    h.write(attempt=2)
    h.advance(10)
    assert h.state(attempt=2) == S.TRANSFER_STATE_DONE  # its registration's deadline is 70 s away
    h.advance(70)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 0)
    assert h.broker.remembered_attempts == 0


def test_a_completed_attempt_answers_repeats_of_its_registration_until_its_deadline():
    h = Harness(config=BrokerConfig(retention_s=5.0))
    h.register(timeout_s=20)
    h.prefill_done()
    h.write()
    assert h.broker.tick() == h.clock.now() + 20
    h.advance(19.5)
    assert h.register(timeout_s=20).state == S.TRANSFER_STATE_DONE
    h.advance(0.5)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 1)


def test_the_number_of_settled_attempts_kept_is_capped_once_their_deadlines_passed():
    h = Harness(config=BrokerConfig(retention_s=1000.0, max_retained_attempts=2, max_unsettled_attempts=2))
    for i in range(3):
        h.register(f"t{i}", timeout_s=10)
        h.cancel(f"t{i}")
    h.broker.tick()
    assert h.broker.remembered_attempts == 3  # each refuses late copies of its registration until its deadline
    h.register("t3", timeout_s=10)
    h.cancel("t3")
    # The hard bound: settled attempts past the cap plus the unsettled cap refuse new ones.
    expect(errors.ResourceExhausted, Reason.TOO_MANY_TRANSFERS, "key", h.register, "t4")
    h.advance(10)
    assert h.broker.remembered_attempts == 2
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t0")
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1")
    assert h.state("t3") == S.TRANSFER_STATE_CANCELLED
    h.register("t4")


def test_too_many_unsettled_attempts_are_refused():
    h = Harness(config=BrokerConfig(max_unsettled_attempts=2))
    h.register("t1")
    h.prefill_done("t2")
    expect(errors.ResourceExhausted, Reason.TOO_MANY_TRANSFERS, "key", h.register, "t3")
    h.prefill_done("t1")
    h.messages()
    h.write("t1")
    h.register("t3")
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_live_attempts") == 2
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_pending_registrations") == 1
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_pending_prefill_dones") == 1


def test_every_table_shrinks_back_once_everything_settled_and_aged_out():
    h = Harness(p_tp=2, d_tp=2, config=BrokerConfig(retention_s=5.0))
    lease = h.registrar.register(sample.rank_request("prefill-1", sample.PREFILL)).lease_id
    baseline = h.broker.memory_sizes
    assert baseline == {
        "transfers": 0,
        "remembered_attempts": 0,
        "timers": 0,
        "engines_indexed": 0,
        "producer_mailboxes": 2,
        "decode_mailboxes": 1,
        "engine_infos": 2,
        "shard_watches": 0,
    }
    h.register("done")  # completed
    h.prefill_done("done")
    h.write("done", tp=0)
    h.write("done", tp=1)
    h.register("sup", 1)  # superseded with unanswered orders: fenced by time
    h.prefill_done("sup", 1)
    h.register("sup", 2, first_block=10)
    h.register("cancelled")  # cancelled, one rank answers, the other lost its stream
    h.prefill_done("cancelled")
    h.unsubscribe_producer(1)
    h.cancel("cancelled")
    h.write("cancelled", tp=0, outcome=REVOKED)
    h.register("expired", timeout_s=2)
    h.cancel("unseen", 3, D)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, "refused", first_block=998)
    expect(errors.FailedPrecondition, Reason.DEADLINE_PASSED, "deadline", h.register, "late", deadline_in=-1)
    # An attempt with an engine that leaves, its order unanswered.
    h.broker.subscribe_producer(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-1", incarnation="inc-1"), "prefill-1")
    h.broker.register_destination(sample.destination_request("lost", prefill_engine_id="prefill-1"), D)
    h.broker.report_prefill_done(sample.prefill_done_request("lost", prefill_engine_id="prefill-1"), "prefill-1")
    h.registrar.deregister(lease, "prefill-1")
    assert h.broker.unsettled_attempts > 0 and h.broker.memory_sizes["transfers"] == 8
    for _ in range(100):  # past every deadline, fencing bound, keep_until and retention
        h.advance(10)
    assert h.broker.unsettled_attempts == 0
    assert h.broker.memory_sizes == baseline
