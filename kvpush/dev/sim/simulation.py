# SPDX-License-Identifier: Apache-2.0
"""One seeded schedule of the whole protocol: the simulated processes, the requests and the faults, and the checks once it quiesced.

Each process runs kvpush's own code — RegistrarCore, BrokerCore,
ProducerCore, ConsumerCore, DecodeWaits — and stands in only for what
surrounds it: gRPC (control_plane.py), vLLM's scheduling (prefill and decode
take time, blocks are allocated and freed: prefill.py, decode.py), the
router's retry policy (router.py) and, in half the schedules, etcd and a
broker of several members with the clients' shard maps (shards.py,
shard_maps.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvpush.dev.sim.checks import Violations
from kvpush.dev.sim.control_plane import ControlPlane
from kvpush.dev.sim.decode import DecodeEngine
from kvpush.dev.sim.nixl import Fabric
from kvpush.dev.sim.prefill import PrefillEngine
from kvpush.dev.sim.router import ClientRequest, Router
from kvpush.dev.sim.shard_maps import Shards
from kvpush.dev.sim.world import Faults, Network, World
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.registrar.config import RegistrarConfig


@dataclass(frozen=True)
class Timing:
    """The schedule's time constants, scaled down from production so a schedule spans seconds."""

    broker: BrokerConfig = BrokerConfig(
        max_clock_skew_s=0.05, write_timeout_s=0.2, stream_lease_s=0.6, fence_margin_s=0.1, retention_s=2.0, max_timeout_s=30.0, outbox_capacity=64
    )
    registrar: RegistrarConfig = RegistrarConfig(default_lease_ttl_s=1.0, min_lease_ttl_s=0.2, max_lease_ttl_s=5.0)
    hold_margin_s: float = 0.5
    rpc_timeout_s: float = 0.3
    rpc_tries: int = 3
    reconnect_s: float = 0.1
    engine_step_s: float = 0.01  # a decode engine's idle step while requests wait
    transfer_poll_s: float = 0.002
    write_time: tuple[float, float] = (0.001, 0.15)
    prefill_time: tuple[float, float] = (0.02, 0.3)
    decode_time: tuple[float, float] = (0.02, 0.2)
    request_timeout: tuple[float, float] = (1.0, 3.0)
    router_slack_s: float = 0.5
    decode_blocks: int = 48
    shard_lease_s: float = 1.0  # a broker member's etcd lease (the shortest the broker allows)


class Simulation:
    """One seeded schedule of requests and faults over the whole protocol."""

    def __init__(self, seed: int, timing: Timing | None = None, members: int | None = None):
        """members: how many broker members (1: the broker in the control plane); None: drawn from the seed."""
        self.world = World(seed)
        # Choices of how the engines work (not faults) draw from their own generator, so
        # adding one leaves every schedule recorded before it (tests/sim/defects.py) as it was.
        self.variants = random.Random(f"kvpush-sim-variants-{seed}")
        self.timing = timing or Timing()
        # Faults added later draw from their own generator too, for the same reason.
        self._doubts = random.Random(f"kvpush-sim-lease-doubts-{seed}")
        self.faults = replace(Faults.draw(self.world.rng, self.timing.broker.max_clock_skew_s),
                              failed_posts=random.Random(f"kvpush-sim-failed-posts-{seed}").choice((0.0, 0.0, 0.1, 0.3)),
                              lease_doubts=self._doubts.choice((0, 0, 1, 2)))
        # Half the schedules serve a hybrid model (a sliding-window group beside full attention): no draw from the
        # world's generator, so such a schedule's events come as before, with one more group in its transfers.
        self.hybrid = random.Random(f"kvpush-sim-hybrid-{seed}").random() < 0.5
        self.violations = Violations(clock=self.world)
        self.network = Network(self.world, self.faults)
        self.fabric = Fabric()
        self._drifted: set[int] = set()
        # A quarter of the schedules run a broker of two members, a quarter of three (a generator of their own, so the
        # one-member schedules recorded before stay as they were); the others one broker in the control plane.
        shard_rng = random.Random(f"kvpush-sim-shards-{seed}")
        count = shard_rng.choice((1, 1, 2, 3))
        count = members if members is not None else count
        self.shards = Shards(self, count, shard_rng) if count > 1 else None
        self.shard_faults: dict[str, int] = {}
        self.cp = ControlPlane(self)
        self.prefill = PrefillEngine(self)
        self.decode = DecodeEngine(self)
        self.router = Router(self)

    def drift(self, request: ClientRequest) -> int:
        """Tokens the prefill engine computes beyond (negative: short of) what the decode engine registers."""
        return -request.num_tokens // 2 if request.index in self._drifted else 0

    def run(self, max_events: int = 200_000) -> Violations:
        world, rng, timing = self.world, self.world.rng, self.timing
        arrivals = 3.0
        requests = [ClientRequest(i, f"t{i}", rng.choice((16, 40, 64, 100)), rng.uniform(*timing.request_timeout), 0.0) for i in range(rng.randint(3, 8))]
        if rng.random() < 0.2:
            self._drifted.add(rng.randrange(len(requests)))
        for request in requests:
            start = rng.uniform(0.3, arrivals)
            request.deadline = start + request.timeout_s
            world.at(start, self.router.proc.later, 0.0, self.router.submit, request)
        self._schedule_faults(requests, arrivals)
        if self.shards is not None:
            self.shard_faults = self.shards.schedule_faults(arrivals)
        world.run(arrivals + timing.request_timeout[1] + 8.0, max_events)
        self._check_quiet(requests)
        return self.violations

    def _schedule_faults(self, requests: list[ClientRequest], horizon: float) -> None:
        world, rng, f = self.world, self.world.rng, self.faults
        when = lambda: rng.uniform(0.2, horizon + 1.0)  # noqa: E731
        for _ in range(f.stream_resets):
            world.at(when(), self._reset_streams)
        for _ in range(f.lease_outages):
            world.at(when(), self._cut, rng.choice((self.prefill, self.decode)), rng.uniform(0.5, 2.5))
        for _ in range(f.pauses):
            world.at(when(), self._pause, rng.uniform(0.2, 2.5))
        for _ in range(f.kills):
            world.at(when(), self._kill, rng.choice(("prefill", "decode", "control-plane")), rng.uniform(0.1, 1.5))
        for _ in range(f.disconnects):
            world.at(when(), self.router.proc.later, 0.0, self.router.disconnect, rng.choice(requests))
        for i in range(f.collisions):
            victim = rng.choice(requests)
            twin = ClientRequest(1000 + i, f"c{i}", victim.num_tokens, victim.timeout_s, 0.0)
            at = rng.uniform(0.3, horizon + 0.5)
            twin.deadline = at + twin.timeout_s
            world.at(at, self._collide, twin, victim)
        for _ in range(f.lease_doubts):
            world.at(self._doubts.uniform(0.2, horizon + 1.0), self._doubt_lease, self._doubts.uniform(0.05, 1.5))
        for i in range(f.malformed):
            bad = ClientRequest(2000 + i, f"m{i}", 40, 1.0, 0.0)
            at = rng.uniform(0.3, horizon)
            bad.deadline = at + bad.timeout_s
            world.at(at, self.router.proc.later, 0.0, lambda b=bad: self.router.submit(b, malformed=True))

    def _reset_streams(self) -> None:
        rng = self.world.rng
        self.cp.break_streams(rng.choice((self.prefill.proc, self.decode.proc, None)), rng.uniform(0.0, 1.0))

    def _collide(self, twin: ClientRequest, victim: ClientRequest) -> None:
        if victim.attempt:
            self.router.submit(twin, collide_with=victim)

    def _cut(self, engine, seconds: float) -> None:
        """A network cut between an engine and the control plane (NIXL stays up)."""
        engine.rpc.cut_until = self.world.time + seconds
        self.cp.break_streams(engine.proc, self.world.rng.uniform(0.0, seconds))
        shards = self.shards
        if shards is not None:
            for member in shards.members:
                member.break_streams(engine.proc, shards.rng.uniform(0.0, seconds))

    def _doubt_lease(self, seconds: float) -> None:
        if self.shards is not None:
            self.shards.doubt_leases(seconds)
        elif self.cp.proc.alive:
            self.cp.doubt_lease(seconds)

    def _pause(self, seconds: float) -> None:
        # A pause within a pause extends it: events held until its end keep their order (a stage's forward ends after the
        # stage before it), where a shorter second pause used to let later events run before the ones held longer.
        proc = self.prefill.proc
        proc.paused_until = max(proc.paused_until, self.world.time + seconds)

    def _kill(self, which: str, downtime: float) -> None:
        parts: dict[str, PrefillEngine | DecodeEngine | ControlPlane] = {"prefill": self.prefill, "decode": self.decode, "control-plane": self.cp}
        parts[which].kill(downtime)

    def _check_quiet(self, requests: list[ClientRequest]) -> None:
        for request in self.router.requests:
            if request.answered is None:
                self.violations.add("hung", f"client request {request.index} never answered")
        left = self.prefill.holds() + self.decode.holds()
        if self.cp.proc.alive and self.cp.broker.unsettled_attempts:
            left.append(f"{self.cp.broker.unsettled_attempts} unsettled attempts at the broker")
        if self.shards is not None and self.shards.unsettled_attempts:
            left.append(f"{self.shards.unsettled_attempts} unsettled attempts at the broker members")
        if len(self.decode.waits):
            left.append(f"{len(self.decode.waits)} decode waits")
        if left:
            self.violations.add("leak", "; ".join(left[:8]))
