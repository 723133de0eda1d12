# SPDX-License-Identifier: Apache-2.0
"""RegistrarCore: validation with exact reasons and fields, leases, incarnations, watches, caps."""

from __future__ import annotations

import pytest

from kvpush import errors
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import ManualClock
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore, RemovalReason

UPSERTED = reg_pb.ENGINE_EVENT_TYPE_UPSERTED
REMOVED = reg_pb.ENGINE_EVENT_TYPE_REMOVED


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def registrar(clock: ManualClock) -> RegistrarCore:
    return RegistrarCore(RegistrarConfig(default_lease_ttl_s=10.0, min_lease_ttl_s=2.0, max_lease_ttl_s=30.0, watch_queue_capacity=8), clock)


@pytest.fixture
def removals(registrar: RegistrarCore) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    registrar.add_removal_listener(lambda *args: seen.append(args))
    return seen


def expect(error_type: type[errors.KvpushError], reason: str, field: str, call, *args):
    with pytest.raises(error_type) as info:
        call(*args)
    assert (info.value.reason, info.value.field) == (reason, field), str(info.value)
    assert info.value.metadata.get("field", "") == field
    return info.value


def events(watch) -> list[tuple[int, str, int, str]]:
    return [(e.type, e.engine.engine_id, e.engine.state, e.reason) for e in watch.outbox.drain()]


# ----- validation -----


def _set(path: str, value):
    def mutate(request: reg_pb.RegisterEngineRankRequest) -> None:
        *parents, leaf = path.split(".")
        target = request
        for part in parents:
            if part.endswith("]"):
                name, index = part[:-1].split("[")
                target = getattr(target, name)[int(index)]
            else:
                target = getattr(target, part)
        setattr(target, leaf, value)

    return mutate


def _clear(field: str):
    return lambda request: request.ClearField(field)


def _duplicate_region(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.layout.regions[1].plane = request.layout.regions[0].plane


def _negative_ttl(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.lease_ttl.seconds = -1


def _clear_groups(request: reg_pb.RegisterEngineRankRequest) -> None:
    del request.layout.groups[:]


def _clear_regions(request: reg_pb.RegisterEngineRankRequest) -> None:
    del request.layout.regions[:]


def _huge_metadata(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.nixl.agent_metadata = b"x" * (4 * 1024 * 1024 + 1)


def _empty_backend(request: reg_pb.RegisterEngineRankRequest) -> None:
    request.nixl.backends.append("")


INVALID_REGISTRATIONS = [
    ("no rank", _clear("rank"), Reason.FIELD_REQUIRED, "rank"),
    ("empty engine id", _set("rank.engine_id", ""), Reason.FIELD_REQUIRED, "rank.engine_id"),
    ("engine id with a space", _set("rank.engine_id", "prefill 0"), Reason.FIELD_INVALID, "rank.engine_id"),
    ("engine id of 129 characters", _set("rank.engine_id", "p" * 129), Reason.FIELD_INVALID, "rank.engine_id"),
    ("empty incarnation", _set("rank.incarnation", ""), Reason.FIELD_REQUIRED, "rank.incarnation"),
    ("unspecified role", _set("rank.role", 0), Reason.FIELD_REQUIRED, "rank.role"),
    ("unknown role", _set("rank.role", 9), Reason.FIELD_INVALID, "rank.role"),
    ("zero tp_size", _set("rank.tp_size", 0), Reason.FIELD_REQUIRED, "rank.tp_size"),
    ("zero pp_size", _set("rank.pp_size", 0), Reason.FIELD_REQUIRED, "rank.pp_size"),
    ("tp_rank not below tp_size", _set("rank.tp_rank", 1), Reason.FIELD_OUT_OF_RANGE, "rank.tp_rank"),
    ("pp_rank not below pp_size", _set("rank.pp_rank", 1), Reason.FIELD_OUT_OF_RANGE, "rank.pp_rank"),
    ("too many ranks", _set("rank.tp_size", 2048), Reason.FIELD_OUT_OF_RANGE, "rank.tp_size"),
    ("no nixl", _clear("nixl"), Reason.FIELD_REQUIRED, "nixl"),
    ("empty agent name", _set("nixl.agent_name", ""), Reason.FIELD_REQUIRED, "nixl.agent_name"),
    ("empty agent metadata", _set("nixl.agent_metadata", b""), Reason.FIELD_REQUIRED, "nixl.agent_metadata"),
    ("agent metadata too large", _huge_metadata, Reason.FIELD_OUT_OF_RANGE, "nixl.agent_metadata"),
    ("empty backend name", _empty_backend, Reason.FIELD_REQUIRED, "nixl.backends[1]"),
    ("no layout", _clear("layout"), Reason.FIELD_REQUIRED, "layout"),
    ("unspecified dtype", _set("layout.dtype", 0), Reason.FIELD_REQUIRED, "layout.dtype"),
    ("zero head size", _set("layout.head_size", 0), Reason.FIELD_REQUIRED, "layout.head_size"),
    ("heads beyond total", _set("layout.first_head", 1), Reason.FIELD_OUT_OF_RANGE, "layout.first_head"),
    ("zero layers", _set("layout.num_layers", 0), Reason.FIELD_REQUIRED, "layout.num_layers"),
    ("unspecified memory kind", _set("layout.memory_kind", 0), Reason.FIELD_REQUIRED, "layout.memory_kind"),
    ("no groups", _clear_groups, Reason.FIELD_REQUIRED, "layout.groups"),
    ("unspecified group kind", _set("layout.groups[0].kind", 0), Reason.FIELD_REQUIRED, "layout.groups[0].kind"),
    ("zero block size", _set("layout.groups[0].block_size", 0), Reason.FIELD_REQUIRED, "layout.groups[0].block_size"),
    ("zero blocks", _set("layout.groups[0].num_blocks", 0), Reason.FIELD_REQUIRED, "layout.groups[0].num_blocks"),
    ("no regions", _clear_regions, Reason.FIELD_REQUIRED, "layout.regions"),
    ("region without base address", _set("layout.regions[3].base_address", 0), Reason.FIELD_REQUIRED, "layout.regions[3].base_address"),
    ("region in unknown group", _set("layout.regions[1].group_index", 5), Reason.FIELD_INVALID, "layout.regions[1].group_index"),
    ("region beyond the layers", _set("layout.regions[2].layer_index", 2), Reason.FIELD_OUT_OF_RANGE, "layout.regions[2].layer_index"),
    ("region without a plane", _set("layout.regions[0].plane", 0), Reason.FIELD_REQUIRED, "layout.regions[0].plane"),
    ("region described twice", _duplicate_region, Reason.FIELD_INVALID, "layout.regions[1].plane"),
    ("region without block stride", _set("layout.regions[0].block_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].block_stride_bytes"),
    ("region without token stride", _set("layout.regions[0].token_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].token_stride_bytes"),
    ("region without head stride", _set("layout.regions[0].head_stride_bytes", 0), Reason.FIELD_REQUIRED, "layout.regions[0].head_stride_bytes"),
    ("empty compatibility hash", _set("compatibility_hash", ""), Reason.FIELD_REQUIRED, "compatibility_hash"),
    ("negative lease ttl", _negative_ttl, Reason.FIELD_OUT_OF_RANGE, "lease_ttl"),
]


@pytest.mark.parametrize("mutate, reason, field", [case[1:] for case in INVALID_REGISTRATIONS], ids=[case[0] for case in INVALID_REGISTRATIONS])
def test_every_invalid_field_is_refused_with_its_reason_and_path(registrar: RegistrarCore, mutate, reason: str, field: str):
    request = sample.rank_request("prefill-0", sample.PREFILL, total_kv_heads=2)
    mutate(request)
    expect(errors.InvalidArgument, reason, field, registrar.register, request)
    assert registrar.get_engine("prefill-0") is None


def test_a_region_with_one_local_head_needs_no_head_stride(registrar: RegistrarCore):
    request = sample.rank_request("decode-0", sample.DECODE, tp_size=2, total_kv_heads=2)
    request.layout.regions[0].head_stride_bytes = 0
    registrar.register(request)
    assert registrar.get_engine("decode-0") is not None


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
