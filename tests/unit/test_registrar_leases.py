# SPDX-License-Identifier: Apache-2.0
"""RegistrarCore: ranks, engine state, incarnations, leases."""

from __future__ import annotations

import pytest
from registrar_harness import REMOVED, UPSERTED, events, expect

from kvpush import errors
from kvpush.clock import ManualClock
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore
from kvpush.services.registrar.directory import RemovalReason

# ----- ranks, state, leases -----


def test_engine_is_partial_until_every_rank_registered(registrar: RegistrarCore):
    watch = registrar.watch()
    first = registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=0, tp_size=2))
    assert registrar.get_engine("decode-0").state == reg_pb.ENGINE_STATE_PARTIAL
    second = registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=1, tp_size=2))
    engine = registrar.get_engine("decode-0")
    assert engine.state == reg_pb.ENGINE_STATE_READY
    assert [r.rank.tp_rank for r in engine.ranks] == [0, 1]
    assert first.lease_id != second.lease_id
    assert events(watch) == [
        (UPSERTED, "decode-0", reg_pb.ENGINE_STATE_PARTIAL, ""),
        (UPSERTED, "decode-0", reg_pb.ENGINE_STATE_READY, ""),
    ]


def test_reregistering_the_same_rank_is_idempotent(registrar: RegistrarCore, clock: ManualClock):
    request = sample.rank_request("prefill-0", sample.PREFILL)
    first = registrar.register(request)
    snapshot = registrar.get_engine("prefill-0")
    clock.advance(5)
    again = registrar.register(request)
    assert again.lease_id == first.lease_id and not again.engine_token
    assert again.expire_time.ToNanoseconds() - first.expire_time.ToNanoseconds() == 5_000_000_000
    assert registrar.get_engine("prefill-0") is snapshot  # nothing changed, so no new snapshot


def test_reregistering_a_rank_with_other_metadata_conflicts(registrar: RegistrarCore):
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    changed = sample.rank_request("prefill-0", sample.PREFILL)
    changed.nixl.agent_metadata = b"other"
    expect(errors.AlreadyExists, Reason.CONFLICTING_DUPLICATE, "rank", registrar.register, changed)


@pytest.mark.parametrize(
    "change, error_type, reason, field",
    [
        (dict(tp_size=4), errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "rank.tp_size"),
        (dict(compatibility_hash="other"), errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "compatibility_hash"),
    ],
)
def test_ranks_of_one_incarnation_must_agree(registrar: RegistrarCore, change, error_type, reason, field):
    registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=0, tp_size=2))
    other = dict(tp_rank=1, tp_size=2) | change
    expect(error_type, reason, field, registrar.register, sample.rank_request("decode-0", sample.DECODE, **other))


def test_ranks_of_one_incarnation_must_share_a_role(registrar: RegistrarCore):
    registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=0, tp_size=2))
    expect(errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "rank.role", registrar.register, sample.rank_request("decode-0", sample.PREFILL, tp_rank=1, tp_size=2))


def test_a_new_incarnation_replaces_every_rank_of_the_old(registrar: RegistrarCore, removals):
    old = [registrar.register(r) for r in sample.engine_requests("decode-0", sample.DECODE, tp_size=2)]
    watch = registrar.watch()
    events(watch)
    registrar.register(sample.rank_request("decode-0", sample.DECODE, incarnation="inc-2", tp_size=2))
    assert events(watch) == [
        (REMOVED, "decode-0", reg_pb.ENGINE_STATE_GONE, RemovalReason.REPLACED),
        (UPSERTED, "decode-0", reg_pb.ENGINE_STATE_PARTIAL, ""),
    ]
    assert removals == [("decode-0", "inc-1", RemovalReason.REPLACED)]
    assert list(registrar.keep_alive([old[0].lease_id, old[1].lease_id], "decode-0").unknown_lease_ids) == [old[0].lease_id, old[1].lease_id]
    assert registrar.get_engine("decode-0").incarnation == "inc-2"


@pytest.mark.parametrize("requested, granted", [(None, 10.0), (0.5, 2.0), (15.0, 15.0), (300.0, 30.0)])
def test_lease_ttl_is_clamped_to_the_configured_bounds(registrar: RegistrarCore, requested, granted):
    response = registrar.register(sample.rank_request("prefill-0", sample.PREFILL, lease_ttl_s=requested))
    assert response.lease_ttl.ToNanoseconds() == int(granted * 1e9)


def test_leases_lapse_unless_renewed(registrar: RegistrarCore, clock: ManualClock, removals):
    watch = registrar.watch()
    prefill = registrar.register(sample.rank_request("prefill-0", sample.PREFILL))
    registrar.register(sample.rank_request("decode-0", sample.DECODE))
    events(watch)
    assert registrar.sweep() == clock.now() + 10.0
    clock.advance(6)
    renewed = registrar.keep_alive([prefill.lease_id, "no-such-lease"], "prefill-0")
    assert list(renewed.unknown_lease_ids) == ["no-such-lease"]
    clock.advance(4)
    next_expiry = registrar.sweep()
    assert registrar.get_engine("decode-0") is None
    assert registrar.get_engine("prefill-0") is not None
    assert next_expiry == clock.now() + 6.0
    assert removals == [("decode-0", "inc-1", RemovalReason.LEASE_EXPIRED)]
    assert events(watch) == [(REMOVED, "decode-0", reg_pb.ENGINE_STATE_GONE, RemovalReason.LEASE_EXPIRED)]
    clock.advance(6)
    assert registrar.sweep() is None
    assert registrar.get_engine("prefill-0") is None


def test_keep_alive_needs_a_lease(registrar: RegistrarCore):
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "lease_ids", registrar.keep_alive, [], "prefill-0")


def test_a_keep_alive_naming_another_engines_lease_renews_nothing(registrar: RegistrarCore, clock: ManualClock):
    prefill = registrar.register(sample.rank_request("prefill-0", sample.PREFILL)).lease_id
    decode = registrar.register(sample.rank_request("decode-0", sample.DECODE)).lease_id
    clock.advance(6)
    error = expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "lease_ids", registrar.keep_alive, [prefill, decode], "prefill-0")
    assert "'prefill-0' may not act for engine 'decode-0'" in error.message
    clock.advance(4)
    registrar.sweep()
    assert registrar.get_engine("prefill-0") is None and registrar.get_engine("decode-0") is None  # neither was renewed
    # Another engine's lease that no longer exists is no one's: it just comes back unknown.
    again = registrar.register(sample.rank_request("decode-0", sample.DECODE)).lease_id
    assert list(registrar.keep_alive([again, decode], "decode-0").unknown_lease_ids) == [decode]


def test_only_the_engine_holding_a_lease_may_deregister_it(registrar: RegistrarCore, removals):
    lease = registrar.register(sample.rank_request("decode-0", sample.DECODE)).lease_id
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "lease_id", registrar.deregister, lease, "prefill-0")
    assert registrar.get_engine("decode-0") is not None and removals == []
    registrar.deregister(lease, "decode-0")
    assert registrar.get_engine("decode-0") is None


def test_wakeup_fires_when_a_lease_may_lapse_sooner(registrar: RegistrarCore, clock: ManualClock):
    wakes: list[float] = []
    registrar.set_wakeup(wakes.append)
    registrar.register(sample.rank_request("prefill-0", sample.PREFILL, lease_ttl_s=20))
    registrar.register(sample.rank_request("decode-0", sample.DECODE, lease_ttl_s=25))
    registrar.register(sample.rank_request("decode-1", sample.DECODE, lease_ttl_s=5))
    assert wakes == [clock.now() + 20, clock.now() + 5]


def test_deregistering_one_rank_leaves_a_partial_engine(registrar: RegistrarCore, removals):
    leases = [registrar.register(r).lease_id for r in sample.engine_requests("decode-0", sample.DECODE, tp_size=2)]
    watch = registrar.watch()
    events(watch)
    response = registrar.deregister(leases[1], "decode-0")
    assert response.engine.state == reg_pb.ENGINE_STATE_PARTIAL
    assert [r.rank.tp_rank for r in response.engine.ranks] == [0]
    assert removals == [("decode-0", "inc-1", RemovalReason.DEREGISTERED)]
    response = registrar.deregister(leases[0], "decode-0")
    assert response.engine.state == reg_pb.ENGINE_STATE_GONE
    assert events(watch) == [
        (UPSERTED, "decode-0", reg_pb.ENGINE_STATE_PARTIAL, RemovalReason.DEREGISTERED),
        (REMOVED, "decode-0", reg_pb.ENGINE_STATE_GONE, RemovalReason.DEREGISTERED),
    ]
    expect(errors.NotFound, Reason.LEASE_NOT_FOUND, "lease_id", registrar.deregister, leases[0], "decode-0")
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "lease_id", registrar.deregister, "", "decode-0")


def test_a_lease_ends_only_by_time_or_deregistration(registrar: RegistrarCore, clock: ManualClock, removals):
    # Like an etcd lease: a KeepAlive stream that ends does not end it, so nothing but TTL or Deregister can.
    assert not hasattr(registrar, "end_leases")
    assert not hasattr(RemovalReason, "KEEPALIVE_STREAM_CLOSED")
    lease = registrar.register(sample.rank_request("prefill-0", sample.PREFILL)).lease_id
    clock.advance(9.5)
    assert registrar.sweep() == clock.now() + 0.5
    assert registrar.lease_engine(lease) == "prefill-0" and removals == []
    registrar.keep_alive([lease], "prefill-0")  # a rank reconnecting renews the same lease
    clock.advance(9.5)
    registrar.sweep()
    assert registrar.lease_engine(lease) == "prefill-0"
    clock.advance(0.5)
    registrar.sweep()
    assert registrar.lease_engine(lease) is None
    assert removals == [("prefill-0", "inc-1", RemovalReason.LEASE_EXPIRED)]


def test_lease_ids_come_from_the_injected_source(clock: ManualClock):
    ids = iter(f"lease-{i}" for i in range(1, 10))
    registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=10.0), clock, new_lease_id=lambda: next(ids))
    first = registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_size=2))
    second = registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=1, tp_size=2))
    assert (first.lease_id, second.lease_id) == ("lease-1", "lease-2")
    assert registrar.register(sample.rank_request("decode-0", sample.DECODE, tp_size=2)).lease_id == "lease-1"  # a repeat draws none
    assert registrar.register(sample.rank_request("decode-0", sample.DECODE, incarnation="inc-2", tp_size=2)).lease_id == "lease-3"
    assert registrar.lease_engine("lease-3") == "decode-0" and registrar.lease_engine("lease-1") is None


@pytest.mark.parametrize("gap_s", [0.0, 4.0], ids=["at once", "later"])
def test_a_lease_registered_twice_identically_lapses_once(registrar: RegistrarCore, clock: ManualClock, removals, gap_s: float):
    request = sample.rank_request("prefill-0", sample.PREFILL)
    lease = registrar.register(request).lease_id
    clock.advance(gap_s)
    assert registrar.register(request).lease_id == lease  # the lease now sits in the expiry heap twice
    watch = registrar.watch()
    events(watch)
    clock.advance(10.0)
    assert registrar.sweep() is None
    assert registrar.get_engine("prefill-0") is None and registrar.lease_engine(lease) is None
    assert removals == [("prefill-0", "inc-1", RemovalReason.LEASE_EXPIRED)]
    assert events(watch) == [(REMOVED, "prefill-0", reg_pb.ENGINE_STATE_GONE, RemovalReason.LEASE_EXPIRED)]


def test_one_of_two_ranks_registered_twice_lapses_alone(registrar: RegistrarCore, clock: ManualClock, removals):
    requests = sample.engine_requests("decode-0", sample.DECODE, tp_size=2)
    leases = [registrar.register(r).lease_id for r in requests]
    registrar.register(requests[1])
    clock.advance(6)
    registrar.keep_alive([leases[0]], "decode-0")
    clock.advance(4)
    registrar.sweep()
    engine = registrar.get_engine("decode-0")
    assert engine.state == reg_pb.ENGINE_STATE_PARTIAL and [r.rank.tp_rank for r in engine.ranks] == [0]
    assert removals == [("decode-0", "inc-1", RemovalReason.LEASE_EXPIRED)]
