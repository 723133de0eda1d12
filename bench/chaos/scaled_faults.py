# SPDX-License-Identifier: Apache-2.0
"""The scaled-out control plane's faults (settings.scaled): a broker shard killed, hung, or killed with etcd's leader, an etcd
member and a registrar replica killed, and the probes that time a shard's failover.

A probe is a transfer whose id hashes to the shard under the map before the
fault, sent straight to P and D (no router retry), one every
PROBE_INTERVAL_S with at most PROBES_IN_FLIGHT at once: the first one that
succeeds says when the shard's transfers had moved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
from collections.abc import Sequence

from bench.chaos.settings import DECODE_ID, HANG_SLACK_S, HOLD_MARGIN_S, PARTITIONED_MEMBER, PREFILL_ID, PROMPT_LENGTHS
from kvpush.dev.localstack.completions import Completion, HttpError
from kvpush.dev.localstack.transfers import Dispatch, dispatch, new_transfer_id
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.shards import owner

# After the control plane is healthy again, the longest a fault may keep the router from serving (or a shard's probes
# from succeeding).
RECOVER_TIMEOUT_S = 180.0
# The probes: one started this often, at most this many at once, each decoding this many tokens.
PROBE_INTERVAL_S = 0.2
PROBES_IN_FLIGHT = 16
PROBE_MAX_TOKENS = 4
# End reasons a failed probe's answer may name (the first found is counted).
PROBE_REASONS = tuple(transfer_pb2.EndReason.Name(value).removeprefix("END_REASON_") for value in transfer_pb2.EndReason.values() if value)


class ScaledFaults:
    """Chaos's faults of the scaled-out control plane (it provides stack, settings and log)."""

    def fault_shard_kill(self) -> dict:
        """kill -9 of broker shard 1: how long until transfers it owned succeed again (on their new owner), then its restart and rejoin."""
        plane = self.stack.scaled
        index = 1
        member = plane.member_id(index)
        members = [plane.member_id(i) for i in range(len(plane.brokers))]
        old_pid = plane.brokers[index].process.pid
        killed = time.monotonic()
        killed_unix = time.time()  # to place the kill among the processes' log lines (the shard map's, etcd's)
        plane.kill_broker(index)
        self.log(f"killed broker shard {member} (pid {old_pid}) with SIGKILL")
        failover = self._probe_owned(member, members, killed, "failover")
        time.sleep(max(0.0, self.settings.part_down_s - (time.monotonic() - killed)))
        restarted = time.monotonic()
        plane.restart_broker(index)
        self.log(f"broker shard {member} restarted (pid {plane.brokers[index].process.pid}) in {time.monotonic() - restarted:.1f} s")
        rejoin = self._probe_owned(member, members, restarted, "rejoin")
        return {"member": member, "killed_pid": old_pid, "killed_unix": killed_unix,
                "failover": failover, "rejoin": rejoin}

    def fault_shard_pause(self) -> dict:
        """SIGSTOP of broker shard 0, the first address of every client's broker target, for pause_s: a hung member keeps its
        connections open and says nothing. How long until transfers it owned succeed again (once etcd drops it), then its
        SIGCONT and rejoin."""
        plane = self.stack.scaled
        index = 0
        member = plane.member_id(index)
        members = [plane.member_id(i) for i in range(len(plane.brokers))]
        process = plane.brokers[index].process
        paused = time.monotonic()
        process.signal(signal.SIGSTOP)
        self.log(f"stopped broker shard {member} (pid {process.pid}) with SIGSTOP for {self.settings.pause_s:g} s")
        try:
            failover = self._probe_owned(member, members, paused, "failover")
            time.sleep(max(0.0, self.settings.pause_s - (time.monotonic() - paused)))
        finally:
            process.signal(signal.SIGCONT)
        resumed = time.monotonic()
        self.log(f"broker shard {member} resumed with SIGCONT")
        rejoin = self._probe_owned(member, members, resumed, "rejoin")
        return {"member": member, "pause_s": self.settings.pause_s, "failover": failover, "rejoin": rejoin}

    def fault_shard_cut_engines(self) -> dict:
        """The partitioned member cut off from engines and router but not from etcd, for pause_s: it keeps its lease, so it must
        step out of the map by itself (no engine stream reaches it while they reach the others); then the path healed."""
        return self._partition(PARTITIONED_MEMBER, [PARTITIONED_MEMBER], "engines and router")

    def fault_shard_cut_etcd(self) -> dict:
        """The partitioned member cut off from every etcd member but not from the engines, for pause_s: it stops serving once
        unsure of its lease, and etcd drops it a lease ttl later; then the path healed."""
        return self._partition(PARTITIONED_MEMBER, [path for path in self.stack.fronts if path.startswith(f"{PARTITIONED_MEMBER}->etcd-")], "etcd")

    def _partition(self, member: str, paths: Sequence[str], cut_from: str) -> dict:
        plane = self.stack.scaled
        members = [plane.member_id(i) for i in range(len(plane.brokers))]
        proxies = [self.stack.fronts[path] for path in paths]
        cut = time.monotonic()
        connections = sum(proxy.cut() for proxy in proxies)
        self.log(f"cut broker shard {member} off from {cut_from} ({connections} connections) for {self.settings.pause_s:g} s")
        try:
            failover = self._probe_owned(member, members, cut, "failover")
            time.sleep(max(0.0, self.settings.pause_s - (time.monotonic() - cut)))
        finally:
            for proxy in proxies:
                proxy.heal()
        healed = time.monotonic()
        self.log(f"broker shard {member}'s path to {cut_from} healed")
        rejoin = self._probe_owned(member, members, healed, "rejoin")
        return {"member": member, "cut_from": cut_from, "cut_s": self.settings.pause_s, "failover": failover, "rejoin": rejoin}

    def fault_leader_shard_kill(self) -> dict:
        """kill -9 of etcd's leader and of broker shard 1 at once: the shard's lease can only lapse once a new etcd leader
        reigns (it renews every lease when it takes over); how long until the shard's transfers succeed again."""
        plane = self.stack.scaled
        etcd = plane.etcd
        leader = _etcd_leader(etcd.endpoints)
        index = 1
        member = plane.member_id(index)
        members = [plane.member_id(i) for i in range(len(plane.brokers))]
        killed = time.monotonic()
        etcd.kill(leader)
        plane.kill_broker(index)
        self.log(f"killed etcd leader (member {leader}) and broker shard {member} with SIGKILL")
        failover = self._probe_owned(member, members, killed, "failover")
        time.sleep(max(0.0, self.settings.part_down_s - (time.monotonic() - killed)))
        etcd.restart(leader)
        plane.restart_broker(index)
        self.log(f"etcd member {leader} and broker shard {member} restarted")
        rejoin = self._probe_owned(member, members, time.monotonic(), "rejoin")
        return {"member": member, "etcd_leader": leader, "failover": failover, "rejoin": rejoin}

    def fault_etcd_kill(self) -> dict:
        etcd = self.stack.scaled.etcd
        index = 0
        etcd.kill(index)
        self.log(f"killed etcd member {index} with SIGKILL")
        time.sleep(self.settings.part_down_s)
        etcd.restart(index)
        self.log(f"etcd member {index} restarted")
        return {"member": index, "down_s": self.settings.part_down_s}

    def fault_registrar_kill(self) -> dict:
        plane = self.stack.scaled
        index = 0  # the first address of the registrars' target: where the engines' channels went first
        old_pid = plane.registrars[index].process.pid
        plane.kill_registrar(index)
        self.log(f"killed registrar replica {index} (pid {old_pid}) with SIGKILL")
        time.sleep(self.settings.part_down_s)
        plane.restart_registrar(index)
        self.log(f"registrar replica {index} restarted (pid {plane.registrars[index].process.pid})")
        return {"replica": index, "killed_pid": old_pid, "down_s": self.settings.part_down_s}

    def fault_registrars_down(self) -> dict:
        """Every registrar replica killed for registrar_outage_s: engines keep their ranks (their etcd leases outlast the
        outage) and brokers keep their engine mirrors, so nothing may fail; then all restarted."""
        plane = self.stack.scaled
        pids = [part.process.pid for part in plane.registrars if part.process is not None]
        for index in range(len(plane.registrars)):
            plane.kill_registrar(index)
        self.log(f"killed every registrar replica (pids {pids}) with SIGKILL for {self.settings.registrar_outage_s:g} s")
        time.sleep(self.settings.registrar_outage_s)
        for index in range(len(plane.registrars)):
            plane.restart_registrar(index)
        self.log("registrar replicas restarted")
        return {"replicas": len(pids), "killed_pids": pids, "down_s": self.settings.registrar_outage_s}

    def _probe_owned(self, member: str, members: Sequence[str], since: float, label: str) -> dict:
        """Transfers owned by member (under `members`), straight to P and D, one started every PROBE_INTERVAL_S until one succeeds.

        Returns when the first succeeded, counted from `since` to the start of
        that probe (a transfer started from then on succeeds), when the first
        success was answered, and how the probes before it ended.
        """
        prompt_index = PROMPT_LENGTHS.index(129)
        expected = self.stack.reference[prompt_index].token_ids
        results: list[tuple[float, Dispatch]] = []
        bound = since + RECOVER_TIMEOUT_S
        with concurrent.futures.ThreadPoolExecutor(PROBES_IN_FLIGHT) as pool:
            pending: dict[concurrent.futures.Future, float] = {}
            first_ok: float | None = None
            while first_ok is None and time.monotonic() < bound:
                if len(pending) < PROBES_IN_FLIGHT:
                    transfer_id = _owned_transfer_id(member, members)
                    started = time.monotonic()
                    pending[pool.submit(self._probe, transfer_id, prompt_index)] = started
                done, _ = concurrent.futures.wait(pending, timeout=PROBE_INTERVAL_S, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    started = pending.pop(future)
                    result = future.result()
                    results.append((started, result))
                    if _probe_ok(result, expected) and (first_ok is None or started < first_ok):
                        first_ok = started
            for future in concurrent.futures.as_completed(pending):
                results.append((pending[future], future.result()))
        reasons: dict[str, int] = {}
        for _, result in results:
            if not _probe_ok(result, expected):
                reason = _probe_reason(result)
                reasons[reason] = reasons.get(reason, 0) + 1
        wrong = sum(1 for _, r in results if isinstance(r.decode, Completion) and not _probe_ok(r, expected))
        seconds = None if first_ok is None else round(first_ok - since, 2)
        # A probe started before the failover may still succeed, later: when the first answer came tells the failover's latency.
        answers = [started + r.seconds for started, r in results if _probe_ok(r, expected)]
        answered = round(min(answers) - since, 2) if answers else None
        self.log(f"{label}: transfers owned by {member} succeed again {seconds} s after (first answered {answered} s after); "
                 f"{len(results)} probes, failed {reasons}")
        return {"seconds": seconds, "answered_s": answered, "probes": len(results), "failed_by_reason": reasons, "wrong": wrong}

    def _probe(self, transfer_id: str, prompt_index: int) -> Dispatch:
        return dispatch(self.stack.engines["prefill"].url, PREFILL_ID, self.stack.engines["decode"].url, DECODE_ID, self.stack.prompts[prompt_index],
                        PROBE_MAX_TOKENS, transfer_id=transfer_id, timeout_ms=self.settings.timeout_ms,
                        http_timeout=self.settings.deadline_s + HOLD_MARGIN_S + HANG_SLACK_S)


def _etcd_leader(endpoints: Sequence[str]) -> int:
    """The index of the etcd member the others follow."""
    from kvpush.etcd.client import EtcdClient

    async def ask() -> int:
        client = EtcdClient(list(endpoints))
        try:
            for index, endpoint in enumerate(endpoints):
                status = await client.status(endpoint)
                if status.leader and status.member_id == status.leader:
                    return index
        finally:
            await client.close()
        raise RuntimeError("no etcd member is the leader")

    return asyncio.run(ask())


def _owned_transfer_id(member: str, members: Sequence[str]) -> str:
    """A new transfer id that member owns among members."""
    while True:
        transfer_id = new_transfer_id()
        if owner(transfer_id, members) == member:
            return transfer_id


def _probe_ok(result: Dispatch, expected: Sequence[int]) -> bool:
    """D answered with the single engine's tokens."""
    decode = result.decode
    return isinstance(decode, Completion) and list(decode.token_ids) == list(expected[:PROBE_MAX_TOKENS])


def _probe_reason(result: Dispatch) -> str:
    """Why a probe failed: D's HTTP status and the kvpush reason its error names, if any."""
    decode = result.decode
    if isinstance(decode, HttpError):
        text = decode.body.decode(errors="replace")
        named = [reason for reason in PROBE_REASONS if reason in text]
        return f"HTTP {decode.status} {named[0] if named else ''}".strip()
    if isinstance(decode, Exception):
        return type(decode).__name__
    return "wrong output"
