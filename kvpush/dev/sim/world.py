# SPDX-License-Identifier: Apache-2.0
"""The simulated world: one seeded RNG, a true clock, per-process clocks, an event queue and a faulty network.

Everything random comes from World.rng, so a seed replays exactly. Each
process reads its own clocks (a monotonic one with its own origin and a wall
clock skewed by at most the configured skew) and can be paused (SIGSTOP:
its events wait) or killed (its incarnation's pending events are dropped).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

WALL_EPOCH = 1_767_225_600.0


@dataclass(frozen=True)
class Faults:
    """How hostile one schedule's network and processes are (drawn per schedule from its seed)."""

    drop: float = 0.0  # probability a unary request or response is lost
    duplicate: float = 0.0  # probability a unary request is delivered twice
    slow: float = 0.0  # probability a message takes long_delay_s instead of milliseconds
    long_delay_s: float = 1.0
    stream_resets: int = 0  # stream breaks injected over the schedule
    lease_outages: int = 0  # windows in which an engine's keep-alives are lost
    pauses: int = 0  # SIGSTOP/SIGCONT of the prefill engine
    kills: int = 0  # kill -9 and restart of an engine or the control plane
    disconnects: int = 0  # clients that hang up mid-request
    collisions: int = 0  # requests reusing another request's transfer key
    malformed: int = 0  # decode legs with unreadable kvpush parameters
    stuck_writes: float = 0.0  # probability a WRITE never completes (the transport aborts it at its timeout)
    failed_posts: float = 0.0  # probability NIXL refuses to post a WRITE (drawn apart: see Simulation)
    lease_doubts: int = 0  # windows in which the broker member cannot be sure of its lease (drawn apart too)
    skew_s: float = 0.0  # wall clocks differ by up to this (within the broker's allowance)

    @staticmethod
    def draw(rng: random.Random, allowance_s: float) -> Faults:
        def some(n: int, p: float = 0.5) -> int:
            return rng.randint(0, n) if rng.random() < p else 0

        return Faults(
            drop=rng.choice((0.0, 0.0, 0.02, 0.1)),
            duplicate=rng.choice((0.0, 0.05, 0.2)),
            slow=rng.choice((0.0, 0.02, 0.1)),
            long_delay_s=rng.choice((0.3, 1.0, 3.0)),
            stream_resets=some(3),
            lease_outages=some(2, 0.3),
            pauses=some(2, 0.3),
            kills=some(2, 0.3),
            disconnects=some(2, 0.3),
            collisions=some(2, 0.3),
            malformed=some(1, 0.2),
            stuck_writes=rng.choice((0.0, 0.0, 0.05, 0.2)),
            skew_s=rng.choice((0.0, allowance_s / 2, allowance_s)),
        )


class Process:
    """Something with its own clocks that can be paused and killed (an engine, a rank, the control plane)."""

    def __init__(self, world: World, name: str, skew_s: float):
        self.world = world
        self.name = name
        self.mono_origin = world.rng.uniform(0, 1000)
        self.skew_s = skew_s
        self.generation = 0  # bumped at each kill: events of an earlier life are dropped
        self.paused_until = 0.0
        self.alive = True
        # Events due while paused, in the order they fell due: they run in that order once the pause ends, however
        # often it was extended (held one by one to its end, an event held before an extension ran after later ones).
        self._held: list[tuple[int, Callable, tuple]] = []

    # Clock protocol (kvpush.clock.Clock)
    def now(self) -> float:
        return self.world.time + self.mono_origin

    def wall(self) -> float:
        return WALL_EPOCH + self.world.time + self.skew_s

    def later(self, delay: float, fn: Callable, *args) -> None:
        """Runs fn(*args) in this process after delay (held while paused, dropped if it dies first)."""
        self.world.at(self.world.time + delay, self._run, self.generation, fn, args)

    def _run(self, generation: int, fn: Callable, args: tuple) -> None:
        if not self.alive or generation != self.generation:
            return
        if self.world.time < self.paused_until:
            if not self._held:
                self.world.at(self.paused_until, self._wake)
            self._held.append((generation, fn, args))
            return
        fn(*args)

    def _wake(self) -> None:
        if self.world.time < self.paused_until:  # the pause was extended
            self.world.at(self.paused_until, self._wake)
            return
        held, self._held = self._held, []
        for generation, fn, args in held:
            self._run(generation, fn, args)

    def kill(self) -> None:
        self.alive = False
        self.generation += 1

    def revive(self) -> None:
        self.alive = True
        self.generation += 1


class World:
    """The event queue over true time."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = random.Random(seed)
        self.time = 0.0
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.events = 0

    def at(self, when: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.time), self._seq, fn, args))

    def run(self, until: float, max_events: int) -> None:
        while self._queue and self._queue[0][0] <= until:
            when, _, fn, args = heapq.heappop(self._queue)
            self.time = when
            fn(*args)
            self.events += 1
            if self.events > max_events:
                raise RuntimeError(f"more than {max_events} events: a livelock")
        self.time = max(self.time, until)


class Network:
    """Delivers messages between processes: milliseconds usually, sometimes long; unary calls may be lost or doubled."""

    def __init__(self, world: World, faults: Faults):
        self.world = world
        self.faults = faults

    def delay(self) -> float:
        rng = self.world.rng
        if rng.random() < self.faults.slow:
            return rng.uniform(0.1, 1.0) * self.faults.long_delay_s
        return rng.uniform(0.0005, 0.005)

    def lost(self) -> bool:
        return self.world.rng.random() < self.faults.drop

    def deliver(self, dst: Process, fn: Callable, *args, lossy: bool = True) -> None:
        """One message; with lossy, it may be lost or arrive twice."""
        if lossy and self.lost():
            return
        dst.later(self.delay(), fn, *args)
        if lossy and self.world.rng.random() < self.faults.duplicate:
            dst.later(self.delay(), fn, *args)


class Stream:
    """An ordered server stream from the control plane to a client; it can break, and each side notices on its own."""

    def __init__(self, network: Network, client: Process, on_message: Callable, on_broken: Callable):
        self.network = network
        self.client = client
        self.on_message = on_message
        self.on_broken = on_broken
        self.broken = False
        self._last_arrival = 0.0

    def send(self, message) -> None:
        if self.broken:
            return
        world = self.network.world
        arrival = max(self._last_arrival, world.time + self.network.delay())
        self._last_arrival = arrival
        self.client.later(arrival - world.time, self._arrive, message)

    def _arrive(self, message) -> None:
        if not self.broken:
            self.on_message(message)

    def break_(self, client_notices_after: float) -> None:
        """Breaks the stream: messages in flight are lost; the client notices after a while."""
        if self.broken:
            return
        self.broken = True
        self.client.later(client_notices_after, self.on_broken)
