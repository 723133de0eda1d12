# SPDX-License-Identifier: Apache-2.0
"""RegistrarCore: describe and list, watches and their queues, caps."""

from __future__ import annotations

from registrar_harness import SNAPSHOT_END, UPSERTED, events, expect

from kvpush import errors
from kvpush.clock import ManualClock
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore

# ----- reads, watches, tokens -----


def test_describe_and_list(registrar: RegistrarCore, clock: ManualClock):
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    lease = registrar.register(sample.rank_request("decode-0", sample.DECODE)).lease_id
    clock.advance(3)
    registrar.keep_alive([lease], "decode-0")
    described = registrar.describe_engine("decode-0")
    assert described.ranks[0].expire_time.ToNanoseconds() == int((clock.wall() + 10) * 1e9)
    assert [e.engine_id for e in registrar.list_engines()] == ["decode-0", "prefill-0"]
    assert [e.engine_id for e in registrar.list_engines(sample.PREFILL)] == ["prefill-0"]
    expect(errors.NotFound, Reason.ENGINE_NOT_FOUND, "engine_id", registrar.describe_engine, "decode-9")
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "role", registrar.list_engines, 7)


def test_a_watch_sends_the_snapshot_then_changes_of_its_role(registrar: RegistrarCore):
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    registrar.register(sample.rank_request("decode-0", sample.DECODE))
    decode_watch = registrar.watch(sample.DECODE)
    all_watch = registrar.watch()
    assert events(decode_watch) == [(UPSERTED, "decode-0", reg_pb.ENGINE_STATE_READY, "")]
    assert [e[1] for e in events(all_watch)] == ["decode-0", "prefill-0"]
    registrar.register(sample.rank_request("prefill-1", sample.PREFILL))
    registrar.register(sample.rank_request("decode-1", sample.DECODE))
    assert [e[1] for e in events(decode_watch)] == ["decode-1"]
    assert [e[1] for e in events(all_watch)] == ["prefill-1", "decode-1"]
    registrar.unwatch(decode_watch)
    assert decode_watch.outbox.closed


def test_a_watch_that_falls_a_queue_behind_is_closed(registrar: RegistrarCore):
    watch = registrar.watch()
    for i in range(9):  # capacity 8
        registrar.register(sample.rank_request(f"decode-{i}", sample.DECODE))
    assert watch.outbox.closed and watch.outbox.dropped == 1
    assert registrar.watch_count == 0


def test_a_snapshot_larger_than_the_queue_still_fits_the_watch_it_is_for(registrar: RegistrarCore):
    for i in range(12):  # more engines than the queue's capacity of 8
        registrar.register(sample.rank_request(f"decode-{i}", sample.DECODE))
    watch = registrar.watch()
    assert not watch.outbox.closed and len(events(watch)) == 12
    # Past the snapshot the bound applies again: a watcher that falls a whole queue behind is closed.
    for i in range(8):
        registrar.register(sample.rank_request(f"prefill-{i}", sample.PREFILL))
    assert not watch.outbox.closed
    registrar.register(sample.rank_request("prefill-8", sample.PREFILL))
    assert watch.outbox.closed


def test_a_new_engine_past_max_engines_is_refused(clock: ManualClock):
    registrar = RegistrarCore(RegistrarConfig(max_engines=2), clock)
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_size=2))
    expect(errors.ResourceExhausted, Reason.TOO_MANY_ENGINES, "rank.engine_id", registrar.register, sample.rank_request("decode-1", sample.DECODE))
    # Engines already registered add ranks and replace their incarnation.
    registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=1, tp_size=2))
    lease = registrar.register(sample.rank_request("prefill-0", sample.PREFILL, incarnation="inc-2")).lease_id
    registrar.deregister(lease, "prefill-0")
    registrar.register(sample.rank_request("decode-1", sample.DECODE))
    assert registrar.engine_count == 2


def test_watches_past_the_cap_of_one_watcher_are_refused(clock: ManualClock):
    registrar = RegistrarCore(RegistrarConfig(max_watches_per_identity=2, watch_queue_capacity=1), clock)
    first, second = registrar.watch(0, "router"), registrar.watch(sample.DECODE, "router")
    expect(errors.ResourceExhausted, Reason.TOO_MANY_WATCHES, "", registrar.watch, 0, "router")
    registrar.watch(0, "prefill-0")  # another watcher's cap
    registrar.unwatch(first)
    third = registrar.watch(0, "router")
    # A watch closed for falling behind counts until it is unwatched, and only once.
    registrar.register(sample.rank_request("decode-0", sample.DECODE))
    registrar.register(sample.rank_request("decode-1", sample.DECODE))
    assert second.outbox.closed and third.outbox.closed
    expect(errors.ResourceExhausted, Reason.TOO_MANY_WATCHES, "", registrar.watch, 0, "router")
    for subscription in (second, second, third):
        registrar.unwatch(subscription)
    registrar.watch(0, "router")
    registrar.watch(0, "router")


def test_a_watch_resumes_after_a_revision_it_saw_while_the_history_holds_it(clock: ManualClock):
    registrar = RegistrarCore(RegistrarConfig(watch_history=3), clock)
    first = registrar.watch()
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    registrar.register(sample.rank_request("decode-0", sample.DECODE))
    seen = first.outbox.drain()
    assert seen[0].revision < seen[1].revision == registrar.revision
    registrar.register(sample.rank_request("decode-1", sample.DECODE))
    resumed = registrar.watch(0, "", seen[1].revision + 1)
    assert [(e.type, e.engine.engine_id) for e in resumed.outbox.drain()] == [(UPSERTED, "decode-1")]  # no snapshot
    assert registrar.watch(0, "", registrar.revision + 1).outbox.drain() == []  # nothing happened since
    assert [e.engine.engine_id for e in registrar.watch(sample.PREFILL, "", seen[0].revision).outbox.drain()] == ["prefill-0"]


def test_a_watch_from_a_revision_no_longer_held_gets_a_snapshot_and_its_end(clock: ManualClock):
    registrar = RegistrarCore(RegistrarConfig(watch_history=2), clock)
    revisions = []
    for i in range(3):
        registrar.register(sample.rank_request(f"decode-{i}", sample.DECODE))
        revisions.append(registrar.revision)
    stale = registrar.watch(0, "", revisions[0])  # the history holds the last two changes only
    events = stale.outbox.drain()
    assert [(e.type, e.engine.engine_id) for e in events] == [(UPSERTED, "decode-0"), (UPSERTED, "decode-1"), (UPSERTED, "decode-2"), (SNAPSHOT_END, "")]
    assert {e.revision for e in events} == {registrar.revision}
    assert [e.engine.engine_id for e in registrar.watch(0, "", revisions[1]).outbox.drain()] == ["decode-1", "decode-2"]  # still held
    # Revisions of an earlier run of the registrar are never resumed into this one's history.
    restarted = RegistrarCore(RegistrarConfig(), clock)
    restarted.register(sample.rank_request("prefill-0", sample.PREFILL))
    assert [e.type for e in restarted.watch(0, "", registrar.revision + 1).outbox.drain()] == [UPSERTED, SNAPSHOT_END]
    expect(errors.InvalidArgument, Reason.FIELD_OUT_OF_RANGE, "start_revision", registrar.watch, 0, "", -1)
