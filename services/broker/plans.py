# SPDX-License-Identifier: Apache-2.0
"""Which engines may take part in a transfer and which producer rank writes to which decode ranks.

Everything here is derived from the registrar's engine snapshots and cached
by the snapshot's identity (a new snapshot object after every change), so
the per-request cost is a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import FailedPrecondition, InvalidArgument, NotFound, Reason
from kvpush.layout import heads, states
from kvpush.layout.geometry import layout_mismatch, window_first_token
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.broker.attempts import RankKey
from kvpush.services.common import validation

PREFILL = engine_pb2.ENGINE_ROLE_PREFILL
DECODE = engine_pb2.ENGINE_ROLE_DECODE
_READY = reg_pb.ENGINE_STATE_READY


class EngineDirectory(Protocol):
    """Where the broker looks engines up: the RegistrarCore in process, or a RemoteEngineDirectory."""

    def get_engine(self, engine_id: str) -> reg_pb.Engine | None:
        """The engine's current snapshot (shared, never mutated; a new object after each change), or None."""

    def add_removal_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """listener(engine_id, incarnation, reason) is called whenever ranks of an engine incarnation leave."""


class Plan:
    """Which producer rank writes to which decode ranks, for one (prefill, decode) incarnation pair.

    A pipeline-parallel prefill engine's ranks are ordered per stage: the
    ranks of one TP position in every stage write the same decode ranks,
    each its stage's layers.
    """

    __slots__ = ("decode_engine", "orders", "expected")

    def __init__(self, decode_engine: reg_pb.Engine, orders: tuple[tuple[RankKey, tuple[int, ...]], ...], expected: tuple[int, ...]):
        self.decode_engine = decode_engine
        self.orders = orders  # producer ranks with at least one consumer, and their consumers
        self.expected = expected  # notifications per decode tp rank


class EngineInfo:
    """What the broker derives from one engine snapshot."""

    __slots__ = ("engine", "groups", "rank_keys", "positions", "rank_heads", "plans")

    def __init__(self, engine: reg_pb.Engine):
        self.engine = engine
        groups: dict[int, tuple[int, int, int]] = {}  # group index -> (block size, block count, sliding window or 0)
        for registered in engine.ranks:
            for group in registered.layout.groups:
                known = groups.get(group.group_index)
                # Ranks of one engine share block tables; the smallest pool is the safe bound.
                groups[group.group_index] = (group.block_size, group.num_blocks if known is None else min(known[1], group.num_blocks),
                                             group.sliding_window if group.kind == engine_pb2.KV_CACHE_GROUP_KIND_SLIDING_WINDOW else 0)
        self.groups = groups
        self.rank_keys: tuple[RankKey, ...] = tuple((engine.engine_id, engine.incarnation, r.rank.tp_rank, r.rank.pp_rank) for r in engine.ranks)
        self.positions = frozenset((r.rank.tp_rank, r.rank.pp_rank) for r in engine.ranks)
        # Every pipeline stage splits heads over its TP ranks alike: the first stage's ranks stand for all.
        self.rank_heads = [heads.RankHeads(r.rank.tp_rank, r.layout.first_head, r.layout.num_local_heads) for r in engine.ranks if r.rank.pp_rank == 0]
        self.plans: dict[str, Plan] = {}  # by decode engine id, for a prefill engine


def invalid(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_INVALID, field=field)


class Planner:
    """Engine checks and routing plans over an EngineDirectory."""

    def __init__(self, directory: EngineDirectory):
        self._directory = directory
        self._infos: dict[str, EngineInfo] = {}

    def info(self, engine: reg_pb.Engine) -> EngineInfo:
        info = self._infos.get(engine.engine_id)
        if info is None or info.engine is not engine:
            info = self._infos[engine.engine_id] = EngineInfo(engine)
        return info

    def forget(self, engine_id: str) -> None:
        """Drops what was derived from an engine that left (and plans towards it)."""
        if self._directory.get_engine(engine_id) is None:
            self._infos.pop(engine_id, None)
        for info in self._infos.values():
            info.plans.pop(engine_id, None)

    @property
    def cached_engines(self) -> int:
        return len(self._infos)

    def engine(self, engine_id: str, role: int, field: str, *, incarnation: str | None = None, incarnation_field: str = "", ready: bool = True) -> EngineInfo:
        """The engine's info; it must exist, have role, (if given) be that incarnation and (if ready) be READY."""
        engine = self._directory.get_engine(engine_id)
        if engine is None:
            validation.check_id(engine_id, field)
            raise NotFound(f"engine {engine_id!r} is not registered", reason=Reason.ENGINE_NOT_FOUND, field=field)
        if engine.role != role:
            raise FailedPrecondition(
                f"engine {engine_id!r} is a {engine_pb2.EngineRole.Name(engine.role)} engine", reason=Reason.ENGINE_ROLE_MISMATCH, field=field
            )
        if incarnation is not None and engine.incarnation != incarnation:
            raise FailedPrecondition(
                f"engine {engine_id!r} is now incarnation {engine.incarnation!r}", reason=Reason.INCARNATION_MISMATCH, field=incarnation_field
            )
        if ready and engine.state != _READY:
            raise FailedPrecondition(f"engine {engine_id!r} is not READY", reason=Reason.ENGINE_NOT_READY, field=field)
        return self.info(engine)

    def rank_lost(self, rank_key: RankKey) -> bool:
        engine = self._directory.get_engine(rank_key[0])
        if engine is None or engine.incarnation != rank_key[1]:
            return True
        return (rank_key[2], rank_key[3]) not in self.info(engine).positions

    def rank_keys_of(self, engine_id: str, incarnation: str, role: int) -> tuple[RankKey, ...]:
        """The ranks of this engine incarnation in that role (none if it is not the one registered)."""
        engine = self._directory.get_engine(engine_id)
        if engine is None or engine.incarnation != incarnation or engine.role != role:
            return ()
        return self.info(engine).rank_keys

    def engine_lost(self, engine_id: str, incarnation: str) -> bool:
        engine = self._directory.get_engine(engine_id)
        return engine is None or engine.incarnation != incarnation

    def plan(self, p_info: EngineInfo, d_info: EngineInfo, field: str, decode_field: str) -> Plan:
        """The (cached) routing plan between two engines; they must be able to exchange KV (field: the peer's, in errors)."""
        p, d = p_info.engine, d_info.engine
        plan = p_info.plans.get(d.engine_id)
        if plan is not None and plan.decode_engine is d:
            return plan
        if p.compatibility_hash != d.compatibility_hash:
            why = layout_mismatch(p.ranks[0].layout, d.ranks[0].layout) if p.ranks and d.ranks else ""
            raise FailedPrecondition(
                f"engines {p.engine_id!r} and {d.engine_id!r} cannot exchange KV: "
                + (why or "they serve different models (architectures, vocabularies or KV cache formats: their compatibility hashes differ)"),
                reason=Reason.INCOMPATIBLE_LAYOUT, field=field,
            )
        if d.pp_size != 1:
            raise FailedPrecondition(f"decode engine {d.engine_id!r} is pipeline-parallel (pp_size {d.pp_size}): kvpush writes only into "
                                     "decode engines of pp_size 1", reason=Reason.INCOMPATIBLE_LAYOUT, field=decode_field)
        p_layout = p.ranks[0].layout if p.ranks else engine_pb2.KvLayout()
        if p.tp_size != d.tp_size and d.ranks:
            for mine, theirs in zip(p_layout.groups, d.ranks[0].layout.groups):
                if mine.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE and not (states.splittable(mine) and states.splittable(theirs)):
                    raise FailedPrecondition(f"engines {p.engine_id!r} and {d.engine_id!r} hold state layers ({mine.state_format}) that do "
                                             f"not say how they split over TP ranks, so they move only between equal TP sizes (prefill "
                                             f"TP {p.tp_size}, decode TP {d.tp_size})", reason=Reason.INCOMPATIBLE_LAYOUT, field=field)
        try:
            # State layers' states split by their own units (Mamba heads, groups): their routes may pair other ranks.
            routes = heads.routes(p_info.rank_heads, d_info.rank_heads) + states.routes(p_layout, p.tp_size, d.tp_size)
        except ValueError as exc:
            raise FailedPrecondition(str(exc), reason=Reason.INCOMPATIBLE_LAYOUT, field=field) from None
        orders = []
        for rank_key in p_info.rank_keys:
            consumers = heads.consumers_of(rank_key[2], routes)
            if consumers:
                orders.append((rank_key, tuple(consumers)))
        # Each stage of a pipeline-parallel prefill engine writes its layers: a decode rank hears from every stage.
        expected = tuple(heads.expected_notifications(tp, routes) * p.pp_size for tp in range(d.tp_size))
        plan = p_info.plans[d.engine_id] = Plan(d, tuple(orders), expected)
        return plan


def check_blocks(blocks, info: EngineInfo, num_tokens: int, first_token: int, side: str) -> None:
    """The block lists must name every KV cache group once, with just enough in-range blocks for the tokens."""
    if num_tokens == 0:
        raise InvalidArgument(f"{side}.num_tokens must be positive", reason=Reason.FIELD_REQUIRED, field=f"{side}.num_tokens")
    if not blocks:
        raise InvalidArgument(f"{side}.blocks is required", reason=Reason.FIELD_REQUIRED, field=f"{side}.blocks")
    groups = info.groups
    seen: set[int] = set()
    for i, block_list in enumerate(blocks):
        group = groups.get(block_list.group_index)
        if group is None or block_list.group_index in seen:
            raise invalid(f"group_index {block_list.group_index} is unknown or listed twice", f"{side}.blocks[{i}].group_index")
        seen.add(block_list.group_index)
        block_size, num_blocks, window = group
        if first_token % block_size:
            raise invalid(f"first_token {first_token} is not a multiple of the block size {block_size}", f"{side}.first_token")
        group_first = max(block_list.first_token, first_token)
        if group_first > first_token:
            # Only a sliding-window group may start later, and never past the window D's first decode step reads.
            latest = window_first_token(first_token, first_token + num_tokens, block_size, window)
            if group_first > latest or group_first % block_size:
                raise invalid(f"group {block_list.group_index} may start at token {latest} at the latest, on a block boundary, not "
                              f"{group_first}" + ("" if window else " (it keeps every token: it is not a sliding-window group)"),
                              f"{side}.blocks[{i}].first_token")
        ids = block_list.block_ids
        needed = -(-(first_token + num_tokens) // block_size) - group_first // block_size
        if len(ids) != needed:
            raise invalid(f"tokens [{group_first}, {first_token + num_tokens}) in blocks of {block_size} need {needed} block ids, not {len(ids)}",
                          f"{side}.blocks[{i}].block_ids")
        if max(ids) >= num_blocks:
            j = next(j for j, block_id in enumerate(ids) if block_id >= num_blocks)
            raise InvalidArgument(
                f"block id {ids[j]} is not below num_blocks {num_blocks}",
                reason=Reason.BLOCK_ID_OUT_OF_RANGE,
                field=f"{side}.blocks[{i}].block_ids[{j}]",
            )
    if len(seen) != len(groups):
        missing = sorted(set(groups) - seen)
        raise InvalidArgument(f"{side}.blocks lacks groups {missing}", reason=Reason.FIELD_REQUIRED, field=f"{side}.blocks")
