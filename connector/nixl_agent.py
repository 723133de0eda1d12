# SPDX-License-Identifier: Apache-2.0
"""A NIXL agent that never spins.

NIXL 1.5.1's Python agent starts the UCX progress thread with no delay, so
it busy-polls a whole core. kvpush creates its agents either without it
(progress is made only by the calls the owning thread makes: posting,
checking transfers, fetching notifications) or with NIXL's progress thread
given a delay: that C++ thread then sleeps in poll() on the UCX worker's
event file and wakes on network events (or after the delay), so a WRITE
over UCX's shared-memory transports completes and its notification arrives
without waiting for either side's Python thread, and without the GIL.
Either way exactly one Python thread (the worker's transfer thread) calls
an agent after its memory is registered.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

HELLO = b"kvpush1|hello"


@dataclass(frozen=True)
class MemoryRange:
    """A registered range: start address, size in bytes, device index."""

    address: int
    size: int
    device: int


@dataclass
class NixlWrite:
    """A WRITE request of this agent: made (its NIXL handle), then posted by start(); release() frees it, posted or not."""

    handle: object
    peer: str
    bytes: int
    descriptors: int


def merge_ranges(ranges: list[MemoryRange]) -> list[MemoryRange]:
    """Coalesces overlapping or touching ranges of the same device."""
    out: list[MemoryRange] = []
    for r in sorted(ranges, key=lambda r: (r.device, r.address)):
        if out and out[-1].device == r.device and r.address <= out[-1].address + out[-1].size:
            last = out[-1]
            end = max(last.address + last.size, r.address + r.size)
            out[-1] = MemoryRange(last.address, end - last.address, last.device)
        else:
            out.append(r)
    return out


def _nixl_agent(name: str, backends: list[str], progress_thread_ms: int):
    if not progress_thread_ms:
        from nixl._api import nixl_agent, nixl_agent_config

        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=backends))
    # With a progress thread UCX locks its worker for every call. Its default lock spins, and a
    # thread spinning for a lock held by a thread the same core has descheduled stalls WRITE posts
    # by milliseconds (measured, bench/results/LOG.md); a mutex sleeps instead. UCX reads this when
    # its library loads: before the first agent of the process, unless the operator chose.
    os.environ.setdefault("UCX_USE_MT_MUTEX", "y")
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind

    # nixl_agent's constructor fixes the progress thread's delay at 0 (a busy loop). Build it
    # without backends, swap in a C++ agent whose progress thread has a delay, then add them.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = int(progress_thread_ms) * 1000  # µs; NIXL rounds it up to whole ms for poll()
    config.lthrDelay = 100_000
    config.captureTelemetry = False
    agent.agent = nixlBind.nixlAgent(name, config)
    for backend in backends:
        if backend in agent.plugin_list:
            agent.create_backend(backend)
    return agent


class KvAgent:
    """One worker's NIXL agent over its KV cache memory."""

    def __init__(self, name: str, backends: list[str], memory_kind: str, progress_thread_ms: int = 0):
        """progress_thread_ms: 0 for no NIXL progress thread; else NIXL's event-driven one, waking at least this often."""
        if memory_kind not in ("DRAM", "VRAM"):
            raise ValueError(f"memory_kind must be DRAM or VRAM, not {memory_kind!r}")
        if progress_thread_ms < 0:
            raise ValueError(f"progress_thread_ms must be 0 or more, not {progress_thread_ms}")
        self.name = name
        self.memory_kind = memory_kind
        self.backends = list(backends)
        self._agent = _nixl_agent(name, self.backends, progress_thread_ms)
        missing = [b for b in self.backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backends {missing} are not available (have {sorted(self._agent.backends)})")
        self._registered = None

    def register(self, ranges: list[MemoryRange]) -> None:
        """Registers the KV cache memory; call once, before metadata()."""
        rows = [(r.address, r.size, r.device, "") for r in merge_ranges(ranges)]
        descs = self._agent.get_reg_descs(rows, self.memory_kind)
        self._registered = self._agent.register_memory(descs, backends=self.backends)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's agent; returns its name."""
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def warm_up(self, peer: str) -> None:
        """Starts connecting to a peer now (a hello notification), so the first WRITE doesn't pay for it.

        Connection setup costs tens of milliseconds over UCX; it completes as
        both agents make progress, long before a request needs it.
        """
        self.send_notif(peer, HELLO)

    def send_notif(self, peer: str, message: bytes) -> None:
        """Sends a notification not bound to a WRITE."""
        self._agent.send_notif(peer, message)

    def make_write(self, peer: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, src_device: int, dst_device: int,
                   notif: bytes) -> NixlWrite:
        """Makes (does not post) one WRITE of the given segments with a completion notification.

        src_device is this rank's device, dst_device the peer rank's: a P/D pair
        on different device indexes must name each side's own.
        """
        n = int(lengths.size)
        src_descs = self._agent.get_xfer_descs(np.stack([src, lengths, np.full(n, src_device, dtype=np.uint64)], axis=1), self.memory_kind)
        dst_descs = self._agent.get_xfer_descs(np.stack([dst, lengths, np.full(n, dst_device, dtype=np.uint64)], axis=1), self.memory_kind)
        handle = self._agent.initialize_xfer("WRITE", src_descs, dst_descs, peer, notif)
        return NixlWrite(handle, peer, int(lengths.sum()), n)

    def prepare_pages(self, peer: str | None, rows: np.ndarray) -> object:
        """Prepares a page table's descriptor list (NIXL strided rows) once: this agent's own (peer None) or a peer's."""
        return self._agent.prep_xfer_dlist(peer or "", rows, self.memory_kind)

    def forget_pages(self, prepared: object) -> None:
        """Frees a prepared list (before its peer is unloaded)."""
        self._agent.release_dlist_handle(prepared)

    def make_pages(self, peer: str, local: object, local_entries: np.ndarray, remote: object, remote_entries: np.ndarray,
                   nbytes: int, notif: bytes) -> NixlWrite:
        """Makes (does not post) one WRITE of prepared page entries (local[i] → remote[i]) with a completion notification.

        No descriptor list is built here: NIXL makes the request from the
        prepared lists and merges entries contiguous on both sides, which
        costs less host time per WRITE than make_write's lists.
        """
        handle = self._agent.make_prepped_xfer("WRITE", local, local_entries, remote, remote_entries, notif)
        return NixlWrite(handle, peer, nbytes, int(local_entries.size))

    def start(self, write: NixlWrite) -> None:
        """Posts a made WRITE. A refused post frees it and raises: nothing of it is in flight."""
        try:
            state = self._agent.transfer(write.handle)
        except Exception:
            self._agent.release_xfer_handle(write.handle)
            raise
        if state == "ERR":
            self._agent.release_xfer_handle(write.handle)
            raise RuntimeError(f"NIXL WRITE to {write.peer} could not be posted")

    def poll(self, write: NixlWrite) -> str:
        """Returns "DONE", "PROC" or "ERR"; progresses the agent."""
        return self._agent.check_xfer_state(write.handle)

    def release(self, write: NixlWrite) -> None:
        """Frees a WRITE's handle: a finished one, one never posted, or (aborting it) one still in flight."""
        self._agent.release_xfer_handle(write.handle)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name; progresses the agent."""
        return self._agent.get_new_notifs()

    def close(self) -> None:
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered, backends=self.backends)
            except Exception:  # teardown: the process is going away either way
                logger.debug("NIXL deregistration failed", exc_info=True)
            self._registered = None
