# SPDX-License-Identifier: Apache-2.0
"""Simulated NIXL: decode-side KV blocks with owners, and WRITEs that land (or not) with their notification.

The transport model is the timing assumption kvpush states (docs/design.md,
A2): a posted WRITE lands within its write timeout or never (a stuck one
fails at the transport's own timeout). Releasing its handle does not recall
what the transport already sent (an RDMA put in the NIC, TCP fragments in
the peer's socket): a released WRITE still lands when it would have, only
without its notification. NIXL may also refuse a post (`failed_posts`).
Landing bytes on a block that is not owned by the request the WRITE was
ordered for is the safety violation the simulation hunts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvpush.connector.nixl_agent import NixlWrite
from kvpush.dev.sim.checks import Violations
from kvpush.dev.sim.world import Process


@dataclass
class BlockOwner:
    req_id: str
    key: tuple[str, int] | None  # None: the request's parameters could not be read


@dataclass
class DecodeMemory:
    """One decode engine incarnation's KV blocks: who owns each, and which WRITEs landed for each request."""

    engine: str
    num_blocks: int
    violations: Violations
    owners: dict[int, BlockOwner] = field(default_factory=dict)
    # req_id -> (producer rank, KV cache group) -> (first_token, num_tokens, prompt id, layers): what its WRITEs (all parts) landed
    landed: dict[str, dict[tuple[int, int], tuple[int, int, int, frozenset[int]]]] = field(default_factory=dict)
    alive: bool = True

    def allocate(self, req_id: str, key: tuple[str, int] | None, count: int) -> list[int] | None:
        free = [b for b in range(self.num_blocks) if b not in self.owners]
        if len(free) < count:
            return None
        blocks = free[:count]
        for b in blocks:
            self.owners[b] = BlockOwner(req_id, key)
        self.landed[req_id] = {}
        return blocks

    def free(self, req_id: str) -> None:
        for b in [b for b, o in self.owners.items() if o.req_id == req_id]:
            del self.owners[b]
        self.landed.pop(req_id, None)

    def land(self, key: tuple[str, int], blocks: tuple[int, ...], producer: tuple[int, int], tokens: tuple[int, int, int, frozenset[int]], what: str) -> str | None:
        """Bytes of a WRITE for key land in blocks (one group's, from producer (rank, group)); returns the owning request, or records a violation."""
        if not self.alive:
            return None  # the process died: its memory is gone
        owners = {self.owners.get(b) and self.owners[b].req_id for b in blocks}
        owner = self.owners.get(blocks[0]) if blocks else None
        if owner is None or len(owners) != 1 or any(self.owners.get(b) is None or self.owners[b].key != key for b in blocks):
            holders = sorted({(o.req_id, o.key) for b in blocks if (o := self.owners.get(b)) is not None})
            self.violations.add("write-after-free", f"{what} for {key} landed on {self.engine} blocks {list(blocks)} now held by {holders or 'nobody'}")
            return None
        landed = self.landed[owner.req_id]
        held = landed.get(producer)
        if held is not None and held[:3] == tokens[:3]:  # another part of the same transfer: its layers add up
            tokens = (*tokens[:3], held[3] | tokens[3])
        landed[producer] = tokens
        return owner.req_id


class SimWrite:
    __slots__ = ("key", "dest", "blocks", "producer", "notif", "land_at", "state", "sender")

    def __init__(self, key, dest, segments, producer, notif, sender):
        # blocks: per KV cache group, (group, its destination blocks, what lands there)
        self.key, self.dest, self.blocks, self.producer, self.notif, self.sender = key, dest, segments, producer, notif, sender
        self.land_at = 0.0
        self.state = "PROC"


class SimPlan:
    """A WritePlan's plan as the simulated transport takes it: per KV cache group, its destination blocks and what lands there."""

    def __init__(self, segments: tuple[tuple[int, tuple[int, ...], tuple], ...]):
        self.src = None
        self.dst = segments  # (group, blocks, (first_token, num_tokens, prompt id, layers))
        self.lengths = None
        self.total_bytes = sum(len(blocks) for _, blocks, _ in segments)

    def __len__(self) -> int:
        return len(self.dst)


class Fabric:
    """Every live decode agent by name; WRITEs find their destination here."""

    def __init__(self) -> None:
        self.agents: dict[str, DecodeAgent] = {}


class DecodeAgent:
    """A decode rank's NIXL agent: its memory and the notifications waiting for its consumer."""

    def __init__(self, name: str, memory: DecodeMemory):
        self.name = name
        self.memory = memory
        self.inbox: dict[str, list[bytes]] = {}

    def notifications(self) -> dict[str, list[bytes]]:
        inbox, self.inbox = self.inbox, {}
        return inbox


class ProducerTransport:
    """A prefill rank's agent (the Transport protocol of kvpush.connector.producer)."""

    def __init__(self, process: Process, fabric: Fabric, name: str, write_time: tuple[float, float], stuck: float, violations: Violations,
                 *, failed_posts: float = 0.0):
        self.process = process
        self.failed_posts = failed_posts
        # Its own generator: schedules without refused posts stay as they were recorded (tests/sim/defects.py).
        self._post_rng = random.Random(f"kvpush-sim-posts-{process.world.seed}-{name}")
        self._hint_rng = random.Random(f"kvpush-sim-hints-{process.world.seed}-{name}")  # likewise for due notifications
        self.fabric = fabric
        self.name = name
        self.write_time = write_time
        self.stuck = stuck
        self.violations = violations
        self.peers: set[str] = set()
        self.made: dict[object, SimWrite] = {}  # made, not posted (kept until posted or released)
        self.in_flight: dict[object, SimWrite] = {}
        self._next = 0
        self.posted_keys: set[tuple[tuple[str, int], str, int]] = set()  # (key, decode agent, part)

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        if any(w.dest == name and w.state == "PROC" for w in self.in_flight.values()):
            self.violations.add("agent-unloaded-in-flight", f"{self.name} unloaded agent {name} with WRITEs to it in flight")
        if any(w.dest == name for w in self.made.values()):
            self.violations.add("agent-unloaded-in-flight", f"{self.name} unloaded agent {name} with WRITEs to it made and not freed")
        self.peers.discard(name)

    def warm_up(self, peer: str) -> None:
        pass

    def send_notif(self, peer: str, message: bytes) -> None:
        """A standalone notification: it arrives a moment later, or never if the peer is gone by then."""
        agent = self.fabric.agents.get(peer)
        if agent is not None:
            world = self.process.world
            world.at(world.time + self._hint_rng.uniform(0.0001, 0.002), self._deliver, agent, peer, message)

    def _deliver(self, agent: DecodeAgent, peer: str, message: bytes) -> None:
        if self.fabric.agents.get(peer) is agent:
            agent.inbox.setdefault(self.name, []).append(message)

    def make_write(self, peer: str, src, dst, lengths, src_device: int, dst_device: int, notif: bytes) -> NixlWrite:
        parts = notif.decode().split("|")
        write = SimWrite((parts[1], int(parts[2])), peer, tuple(dst), int(parts[3]), notif, self.name)
        self._next += 1
        self.made[self._next] = write
        return NixlWrite(self._next, peer, sum(len(blocks) for _, blocks, _ in write.blocks), 1)

    # The simulated layout has no page tables (LocalLayout.pages is None), so the core never asks for page WRITEs.
    def prepare_pages(self, peer: str | None, rows) -> object:
        raise NotImplementedError("the simulation writes byte segments only")

    def forget_pages(self, prepared: object) -> None:
        raise NotImplementedError("the simulation writes byte segments only")

    def make_pages(self, peer: str, local, local_entries, remote, remote_entries, nbytes: int, notif: bytes) -> NixlWrite:
        raise NotImplementedError("the simulation writes byte segments only")

    def start(self, write: NixlWrite) -> None:
        sim = self.made.pop(write.handle)
        if self.failed_posts and self._post_rng.random() < self.failed_posts:
            raise RuntimeError(f"NIXL WRITE to {write.peer} could not be posted")  # what KvAgent.start raises, the WRITE freed
        part = int(sim.notif.decode().split("|")[7])
        if (sim.key, sim.dest, part) in self.posted_keys:
            self.violations.add("double-write", f"{self.name} posted a second WRITE for {sim.key} part {part} to {sim.dest}")
        self.posted_keys.add((sim.key, sim.dest, part))
        world = self.process.world
        self.in_flight[write.handle] = sim
        if world.rng.random() >= self.stuck:
            sim.land_at = world.time + world.rng.uniform(*self.write_time)
            world.at(sim.land_at, self._land, sim)

    def _land(self, write: SimWrite) -> None:
        if write.state == "RELEASED":
            # Released in flight: the bytes already sent land all the same, with no notification.
            agent = self.fabric.agents.get(write.dest)
            if agent is not None:
                self._land_segments(agent, write, "released WRITE")
            return
        if write.state != "PROC":
            return
        write.state = "DONE"
        agent = self.fabric.agents.get(write.dest)
        if agent is None:
            write.state = "ERR"
            return
        if self._land_segments(agent, write, "WRITE"):
            world = self.process.world
            world.at(world.time + world.rng.uniform(0.0001, 0.002), self._notify, agent, write)

    def _land_segments(self, agent: DecodeAgent, write: SimWrite, what: str) -> bool:
        """Lands each group's segment; whether every one reached its owner."""
        owners = [agent.memory.land(write.key, blocks, (write.producer, group), tokens, f"{self.name}'s {what}") for group, blocks, tokens in write.blocks]
        return all(owner is not None for owner in owners)

    def _notify(self, agent: DecodeAgent, write: SimWrite) -> None:
        self._deliver(agent, write.dest, write.notif)

    def poll(self, write: NixlWrite) -> str:
        sim = self.in_flight[write.handle]
        if sim.state == "PROC" and sim.dest not in self.fabric.agents:
            sim.state = "ERR"  # the peer went away: the transport fails the transfer
        return sim.state

    def release(self, write: NixlWrite) -> None:
        self.made.pop(write.handle, None)  # made, never posted: nothing was sent
        sim = self.in_flight.pop(write.handle, None)
        if sim is not None and sim.state == "PROC":
            sim.state = "RELEASED"

    def notifications(self) -> dict[str, list[bytes]]:
        return {}
