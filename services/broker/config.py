# SPDX-License-Identifier: Apache-2.0
"""Broker settings: timeout bound, fencing timing, memory bounds, stream queue sizes, the registrar it mirrors and its shard membership."""

from __future__ import annotations

import dataclasses

from kvpush.services.common.validation import ID_PATTERN
from kvpush.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class BrokerConfig(Settings):
    """Bounds on what the broker accepts and remembers."""

    # max_timeout_s caps RegisterDestination/ReportPrefillDone timeouts.
    max_timeout_s: float = setting(
        600.0, flag="--max-timeout", env="KVPUSH_MAX_TIMEOUT_S", convert=float, positive=True, help="longest transfer timeout accepted"
    )
    # max_unsettled_attempts caps attempts still live or waiting to be fenced.
    max_unsettled_attempts: int = setting(
        200_000, flag="--max-attempts", env="KVPUSH_MAX_ATTEMPTS", convert=int, at_least=1, help="most transfer attempts live or awaiting fencing at once"
    )
    # retention_s keeps settled attempts (answers to repeats, tombstones
    # refusing late or superseded messages) this long after they settle.
    retention_s: float = setting(60.0, flag="--retention", env="KVPUSH_RETENTION_S", convert=float, at_least=0, help="seconds ended attempts are remembered")
    # max_retained_attempts caps settled attempts kept, oldest dropped first.
    max_retained_attempts: int = setting(
        500_000, flag="--max-retained-attempts", env="KVPUSH_MAX_RETAINED_ATTEMPTS", convert=int, at_least=1, help="most ended attempts remembered"
    )
    # outbox_capacity is how many messages may wait for one stream; past it
    # the stream is closed and its subscriber resyncs on its next stream.
    outbox_capacity: int = setting(
        65_536, flag="--outbox-capacity", env="KVPUSH_OUTBOX_CAPACITY", convert=int, at_least=1, help="messages queued per stream before it is reset"
    )
    max_text_length: int = 256
    # Fencing timing (docs/design.md, "Fencing"). max_clock_skew_s bounds the
    # difference between any two hosts' wall clocks; write_timeout_s is how
    # long a posted WRITE may take before its rank aborts it; stream_lease_s
    # is how long a producer rank acts on orders after the last message its
    # stream brought; fence_margin_s covers an abort's own latency and clock
    # rate drift.
    max_clock_skew_s: float = setting(
        0.25, flag="--max-clock-skew", env="KVPUSH_MAX_CLOCK_SKEW_S", convert=float, at_least=0, help="largest wall-clock difference between hosts"
    )
    write_timeout_s: float = setting(
        3.0, flag="--write-timeout", env="KVPUSH_WRITE_TIMEOUT_S", convert=float, positive=True, help="seconds a posted WRITE may take before it is aborted"
    )
    stream_lease_s: float = setting(
        3.0, flag="--stream-lease", env="KVPUSH_STREAM_LEASE_S", convert=float, help="seconds a producer acts on orders after its stream's last message"
    )
    fence_margin_s: float = setting(
        1.0, flag="--fence-margin", env="KVPUSH_FENCE_MARGIN_S", convert=float, positive=True, help="slack added to every fencing bound"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stream_lease_s <= self.max_clock_skew_s:
            raise ValueError(f"--stream-lease ({self.stream_lease_s:g}) must exceed --max-clock-skew ({self.max_clock_skew_s:g})")

    @property
    def startup_grace_s(self) -> float:
        """How long a new broker vouches for no fencing: a predecessor's orders may be acted on that long."""
        return self.stream_lease_s + self.write_timeout_s + self.fence_margin_s


@dataclasses.dataclass(frozen=True)
class UpstreamRegistrar(Settings):
    """The registrar a broker running alone mirrors engines from."""

    target: str = setting("127.0.0.1:50052", flag="--registrar", env="KVPUSH_REGISTRAR", help="registrar address (host:port)")
    timeout_s: float = setting(5.0, flag="--registrar-timeout", env="KVPUSH_REGISTRAR_TIMEOUT_S", convert=float, help="deadline of each call to the registrar")

@dataclasses.dataclass(frozen=True)
class ShardMembership(Settings):
    """Which member of a sharded broker this one is (the members meet on kvpush.etcd.settings.EtcdSettings' etcd)."""

    # member_id stays the same across restarts (a StatefulSet pod name), so a
    # restarted member owns the same transfers again.
    member_id: str = setting("", flag="--member-id", env="KVPUSH_BROKER_MEMBER_ID", help="this broker member's id in the shard map")
    # advertise is what engines and routers dial; unset, the --listen address
    # with the port actually bound (which must then not be a wildcard).
    advertise: str = setting("", flag="--advertise", env="KVPUSH_BROKER_ADVERTISE", metavar="HOST:PORT", help="address others reach this member at")
    # lease_ttl_s: how long a dead or cut-off member keeps its transfers; a
    # member stops serving as soon as it cannot be sure it still holds it.
    lease_ttl_s: int = setting(
        2, flag="--shard-lease-ttl", env="KVPUSH_SHARD_LEASE_TTL_S", convert=int, at_least=1, help="seconds of the member's etcd lease"
    )
    # engine_silence_s: how long a member no engine reaches (while another
    # member is reached) keeps its transfers before it steps out of the map
    # (services/broker/engine_reach.py); every engine streams to every member.
    engine_silence_s: float = setting(
        1.0, flag="--engine-silence", env="KVPUSH_BROKER_ENGINE_SILENCE_S", convert=float, at_least=0,
        help="seconds without any engine stream, while another member has some, before this member steps out of the map (0: never)",
    )

    def check_on_etcd(self, listen: str) -> None:
        """What a broker on etcd needs: a valid --member-id, and an address to advertise (a wildcard --listen needs --advertise)."""
        if ID_PATTERN.fullmatch(self.member_id) is None:
            raise ValueError(f"a broker on etcd needs --member-id, a valid id (1-128 of letters, digits, '.', '_', ':', '-'), not {self.member_id!r}")
        self.address(listen, 0)

    def address(self, listen: str, port: int) -> str:
        """The address to advertise for a server bound to port from listen."""
        if self.advertise:
            return self.advertise
        host = listen.rsplit(":", 1)[0]
        if host in ("", "0.0.0.0", "[::]", "::"):
            raise ValueError(f"--listen {listen} is every interface: say which address others reach this member at with --advertise")
        return f"{host}:{port}"
