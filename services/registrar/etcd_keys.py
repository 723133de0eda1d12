# SPDX-License-Identifier: Apache-2.0
"""How the etcd-backed registrar lays out its keys and values under the deployment's prefix.

- `<prefix>engines/<engine_id>/<incarnation>/<pp_rank>-<tp_rank>`: a
  registered rank, attached to that rank's own etcd lease. Its value is an
  Engine message holding that one rank: the engine fields its ranks share,
  register_time (when this rank registered) and the rank's expire_time
  (register_time + the granted TTL).
- `<prefix>departures/<engine_id>/<incarnation>`: written in the same
  transaction that deletes ranks on purpose; its value is the reason
  (DEREGISTERED or REPLACED). A rank deleted in a revision without one left
  because its lease expired.

Engine ids hold no '/' (they are [A-Za-z0-9._:-]); an incarnation may, so
keys are read from both ends.
"""

from __future__ import annotations

import re

from kvpush.clock import timestamp
from kvpush.etcd.client import prefix_end
from kvpush.etcd.v1 import etcd_pb2
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar.directory import Position
from kvpush.services.registrar.engine_message import engine_message

_LEASE_NAME = re.compile(r"[0-9a-f]{1,16}")
_LESS, _TARGET_MOD_REVISION = 2, 2  # etcd's Compare.result LESS and Compare.target MOD


class EtcdKeys:
    """The registrar's keys under one prefix (e.g. "/kvpush/")."""

    def __init__(self, prefix: str):
        self.root = prefix.encode()
        self.engines = self.root + b"engines/"
        self.departures = self.root + b"departures/"

    def engine(self, engine_id: str) -> bytes:
        """The prefix of every rank of every incarnation of an engine."""
        return self.engines + engine_id.encode() + b"/"

    def rank(self, engine_id: str, incarnation: str, position: Position) -> bytes:
        return self.engine(engine_id) + f"{incarnation}/{position[0]}-{position[1]}".encode()

    def departure(self, engine_id: str, incarnation: str) -> bytes:
        return self.departures + f"{engine_id}/{incarnation}".encode()

    def parse_rank(self, key: bytes) -> tuple[str, str, Position] | None:
        """(engine_id, incarnation, position) of a rank key, or None for any other key."""
        if not key.startswith(self.engines):
            return None
        engine_id, _, rest = key[len(self.engines) :].decode().partition("/")
        incarnation, _, position = rest.rpartition("/")
        pp, _, tp = position.partition("-")
        if not (engine_id and incarnation and pp.isdigit() and tp.isdigit()):
            return None
        return engine_id, incarnation, (int(pp), int(tp))

    def parse_departure(self, key: bytes) -> tuple[str, str] | None:
        """(engine_id, incarnation) of a departure key, or None for any other key."""
        if not key.startswith(self.departures):
            return None
        engine_id, _, incarnation = key[len(self.departures) :].decode().partition("/")
        return (engine_id, incarnation) if engine_id and incarnation else None


def encode_rank(request: reg_pb.RegisterEngineRankRequest, ttl_s: float, register_wall: float) -> bytes:
    """A rank key's value: the registration as an Engine of one rank."""
    rank = request.rank
    registered = reg_pb.RegisteredRank(rank=rank, nixl=request.nixl, layout=request.layout, expire_time=timestamp(register_wall + ttl_s))
    return engine_message(rank, request.compatibility_hash, register_wall, ranks=[registered]).SerializeToString()


def decode_rank(value: bytes) -> tuple[reg_pb.Engine, float, float]:
    """(the stored Engine of one rank, its lease TTL in seconds, its registration wall time) from a rank key's value."""
    engine = reg_pb.Engine.FromString(value)
    register_wall = engine.register_time.ToNanoseconds() / 1e9
    ttl_s = engine.ranks[0].expire_time.ToNanoseconds() / 1e9 - register_wall
    return engine, ttl_s, register_wall


def lease_name(lease: int) -> str:
    """The registrar's lease_id for an etcd lease: its id in hex."""
    return f"{lease:x}"


def lease_number(lease_id: str) -> int | None:
    """The etcd lease a lease_id names, or None when it names none."""
    if _LEASE_NAME.fullmatch(lease_id) is None:
        return None
    number = int(lease_id, 16)
    return number if 0 < number < 2**63 else None


def unchanged_since(prefix: bytes, revision: int) -> etcd_pb2.Compare:
    """A Txn guard: no key under prefix was created or changed after revision.

    A rank registration reads its engine's keys, checks the new rank against
    them, and commits only if they are still what it read, so two replicas
    registering ranks of one engine at once cannot both admit ranks that
    disagree (the second one retries and sees the first).
    """
    return etcd_pb2.Compare(result=_LESS, target=_TARGET_MOD_REVISION, key=prefix, range_end=prefix_end(prefix), mod_revision=revision + 1)
