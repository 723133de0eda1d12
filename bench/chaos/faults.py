# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The faults, injected one after another under load over one stack, and the figures of each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
from collections.abc import Sequence
from typing import Any

from bench.chaos.client import send
from bench.chaos.load import Load
from bench.chaos.log import Log
from bench.chaos.outcomes import Outcome, classify, summarize
from bench.chaos.scaled_faults import RECOVER_TIMEOUT_S, ScaledFaults
from bench.chaos.settings import DECODE_ID, FAULTS, HANG_SLACK_S, HOLD_MARGIN_S, PREFILL_ID, PROMPT_LENGTHS, ROLES, Settings
from bench.chaos.stack import Stack
from kvpush.client import ClientConfig, ShardedBrokerClient
from kvpush.dev.localstack.completions import completion_body
from kvpush.dev.localstack.transfers import new_transfer_id, transfer_params
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2


class Chaos(ScaledFaults):
    """Runs the faults one after another over one stack and collects the figures."""

    def __init__(self, stack: Stack, settings: Settings, log: Log):
        self.stack = stack
        self.settings = settings
        self.log = log
        self.started = time.monotonic()
        self.load = Load(stack, settings, log, self.started)

    def wait_serving(self, since: float, timeout: float = RECOVER_TIMEOUT_S) -> float | None:
        """Seconds from `since` until a request through the router succeeds (load or a probe); None if not within timeout."""
        deadline = time.monotonic() + timeout
        probe = completion_body(self.stack.prompts[1], 2)
        while time.monotonic() < deadline:
            if self.load.last_ok_at > since:
                return self.load.last_ok_at - since
            reply = send(self.stack.router_url, "/v1/completions", probe, hang_after_s=self.settings.deadline_s + HANG_SLACK_S)
            if reply.status == 200 and reply.done:
                return time.monotonic() - since
            time.sleep(0.25)
        return None

    def settle_kv(self) -> dict[str, Any]:
        """Waits until P and D have every KV block free again (bounded by deadline + hold margin + 30 s)."""
        t0 = time.monotonic()
        bound = self.settings.deadline_s + HOLD_MARGIN_S + 30.0
        while True:
            free = self.stack.kv_free()
            settled = all(free.get(role) == self.stack.kv_baseline.get(role) for role in ROLES)
            if settled or time.monotonic() - t0 > bound:
                break
            time.sleep(0.5)
        return {
            "free": free,
            "total": dict(self.stack.kv_total),
            "baseline_free": dict(self.stack.kv_baseline),
            "all_free": settled,
            "settle_s": round(time.monotonic() - t0, 2),
        }

    def run_fault(self, name: str) -> dict[str, Any]:
        settings = self.settings
        self.log(f"=== {name}: {FAULTS[name]}")
        failures_before = self.stack.router_failures()
        t_phase = time.monotonic()
        self.load.start(name)
        time.sleep(settings.pre_s)
        injected = time.monotonic()
        notes = getattr(self, "fault_" + name.replace("-", "_"))()
        healed = time.monotonic()
        recovered = self.wait_serving(healed)
        self.log(f"{name}: injected for {healed - injected:.1f} s; router serving again {recovered if recovered is None else round(recovered, 2)} s after")
        time.sleep(settings.post_s)
        self.load.stop()
        kv = self.settle_kv()
        self.log(f"{name}: KV free {kv['free']} (baseline {kv['baseline_free']}), {'settled' if kv['all_free'] else 'NOT settled'} "
                 f"after {kv['settle_s']} s")
        outcomes = [o for o in self.load.outcomes if o.phase == name]
        routed = [o for o in outcomes if o.source == "router"]
        failures_after = self.stack.router_failures()
        router_counts = {k: v - failures_before.get(k, 0.0) for k, v in failures_after.items() if v - failures_before.get(k, 0.0) > 0}
        summary = {
            "fault": name,
            "what": FAULTS[name],
            "phase_s": round(time.monotonic() - t_phase, 1),
            "fault_s": round(healed - injected, 2),
            "recovered_s": None if recovered is None else round(recovered, 2),
            "routed": summarize(routed),
            "direct": summarize([o for o in outcomes if o.source != "router"]),
            "router_failed_requests_total": router_counts,
            "kv": kv,
            "notes": notes,
        }
        self._print_fault(summary)
        return summary

    def _print_fault(self, summary: dict[str, Any]) -> None:
        r = summary["routed"]
        over = r["max_failure_minus_deadline_s"]
        self.log(f"{summary['fault']}: routed {r['requests']} = ok {r['ok']} / failed {r['failed']} / hung {r['hung']} / wrong {r['wrong']} / "
                 f"disconnected {r['disconnected']}; max failure - deadline {over if over is None else f'{over:+.2f} s'}; "
                 f"late {r['late_failures']}, without reason {r['failures_without_reason']}")
        for reason, count in r["failures_by_reason"].items():
            self.log(f"    {count:5d} x {reason}")
        d = summary["direct"]
        if d["requests"]:
            self.log(f"{summary['fault']}: direct {d['requests']} = ok {d['ok']} / failed {d['failed']} / hung {d['hung']} / wrong {d['wrong']}")

    # Each fault_* injects its fault, undoes it and returns notes; the load runs throughout.

    def fault_p_kill(self) -> dict:
        return self._kill_and_restart("prefill")

    def fault_d_kill(self) -> dict:
        return self._kill_and_restart("decode")

    def _kill_and_restart(self, role: str) -> dict:
        old_pid = self.stack.engines[role].pid
        t0 = time.monotonic()
        self.stack.kill_engine(role)
        self.log(f"killed {role} (process group {old_pid}) with SIGKILL; restarting it")
        handle = self.stack.start_engine(role)
        restart_s = time.monotonic() - t0
        self.log(f"{role} healthy again after {restart_s:.1f} s (pid {handle.pid})")
        return {"killed_pid": old_pid, "new_pid": handle.pid, "down_s": round(restart_s, 1)}

    def fault_cp_kill(self) -> dict:
        old_pid = self.stack.cp.process.pid
        self.stack.kill_control_plane()
        time.sleep(self.settings.cp_down_s)
        t0 = time.monotonic()
        self.stack.restart_control_plane()
        self.log(f"control plane killed (pid {old_pid}) and restarted on the same port (pid {self.stack.cp.process.pid}) "
                 f"in {time.monotonic() - t0:.1f} s")
        return {"killed_pid": old_pid, "new_pid": self.stack.cp.process.pid, "down_s": round(self.settings.cp_down_s + time.monotonic() - t0, 2)}

    def fault_p_stop(self) -> dict:
        self.stack.signal_engine("prefill", signal.SIGSTOP)
        time.sleep(self.settings.stop_s)
        self.stack.signal_engine("prefill", signal.SIGCONT)
        self.log(f"P stopped for {self.settings.stop_s:g} s, continued")
        return {"stopped_s": self.settings.stop_s}

    def fault_proxy_cut(self) -> dict:
        cut = self.stack.proxy.cut()
        time.sleep(self.settings.cut_s)
        self.stack.proxy.heal()
        self.log(f"proxy cut {cut} connections, refused new ones for {self.settings.cut_s:g} s, healed")
        return {"cut_connections": cut, "cut_s": self.settings.cut_s, "proxy": self.stack.proxy.stats.as_dict()}


    def fault_disconnects(self) -> dict:
        self.load.disconnect_share = self.settings.disconnect_share
        time.sleep(self.settings.disconnect_s)
        self.load.disconnect_share = 0.0
        return {"share": self.settings.disconnect_share, "seconds": self.settings.disconnect_s}

    def fault_collide(self) -> dict:
        cases = []
        for round_ in range(self.settings.collide_rounds):
            cases.append(self._collide("decodes-first", round_))
            cases.append(self._collide("prefill-first", round_))
            cases.append(self._collide("other-length", round_))
            cases.append(self._collide("other-prompt-first", round_))
        malformed = self._malformed()
        return {"collisions": cases, "malformed": malformed}

    def _direct(self, role: str, prompt_index: int, max_tokens: int, params: dict | None, label: str, *, prompt: list[int] | None = None,
                expected: Sequence[int] | None = None, check_tokens: bool = True) -> Outcome:
        """One request straight to an engine (no router), recorded under the current phase."""
        handle = self.stack.engines[role]
        tokens = prompt if prompt is not None else self.stack.prompts[prompt_index]
        if expected is None and check_tokens:
            expected = self.stack.reference[prompt_index].token_ids
        body = completion_body(tokens, max_tokens, kv_transfer_params=params)
        timeout_ms = (params or {}).get("kvpush", {}).get("timeout_ms") if isinstance((params or {}).get("kvpush"), dict) else None
        deadline_s = (timeout_ms if isinstance(timeout_ms, (int, float)) and 0 < timeout_ms < 60_000 else self.settings.timeout_ms) / 1000
        # Straight to D a failure comes only once its blocks are safe: by the deadline plus the hold margin.
        deadline_s += HOLD_MARGIN_S if role == "decode" else 0.0
        start_s = time.monotonic() - self.started
        reply = send(handle.url, "/v1/completions", body, hang_after_s=deadline_s + HANG_SLACK_S, headers={"X-Request-Id": label})
        result, reason, detail = classify(reply, expected if check_tokens else None, max_tokens)
        if result == "failed" and not reason:
            reason = f"ENGINE_{reply.status or 'NO_ANSWER'}"
        outcome = Outcome(self.load.phase, f"direct-{role[0]}", label, len(tokens), max_tokens, False, round(start_s, 3), round(reply.elapsed_s, 3),
                          deadline_s, reply.status, result, reason, detail or (reply.error or {}).get("message", "")[:200])
        self.load.record(outcome)
        if result in ("wrong", "hung"):
            self.log(f"{result.upper()}: {label}: {detail}")
        return outcome

    def _collide(self, order: str, round_: int) -> dict:
        """Two decode legs with one transfer key (+ the prefill leg): at most one may get the KV, and only with the right tokens."""
        transfer_id = new_transfer_id()
        timeout_ms = self.settings.timeout_ms
        d_params = transfer_params("decode", transfer_id, PREFILL_ID, timeout_ms=timeout_ms)
        p_params = transfer_params("prefill", transfer_id, DECODE_ID, timeout_ms=timeout_ms)
        first = PROMPT_LENGTHS.index(300)
        second = PROMPT_LENGTHS.index(40) if order.startswith("other") else first
        label = f"collide-{order}-{round_}"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            if order == "prefill-first":
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
                time.sleep(0.05)
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                time.sleep(0.05)
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
            elif order == "other-prompt-first":
                # The other prompt holds the key: P's prompt must not fill its blocks (PROMPT_MISMATCH).
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
                time.sleep(0.3)
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                time.sleep(0.3)
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
            else:
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
                time.sleep(0.3)
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
            results = {"d1": d1.result(), "d2": d2.result(), "p": p.result()}
        record = _broker_record(self.stack, transfer_id)
        decoded = [name for name in ("d1", "d2") if results[name].status == 200]
        case = {
            "order": order,
            "transfer_id": transfer_id,
            "outcomes": {k: {"status": v.status, "result": v.result, "elapsed_s": v.elapsed_s, "detail": v.detail[:160]} for k, v in results.items()},
            "broker": record,
            "at_most_one_decode_answered": len(decoded) <= 1,
            "no_wrong_or_hung": all(v.result not in ("wrong", "hung") for v in results.values()),
        }
        self.log(f"{label}: d1 {results['d1'].result} ({results['d1'].status}, {results['d1'].elapsed_s:.2f} s), "
                 f"d2 {results['d2'].result} ({results['d2'].status}, {results['d2'].elapsed_s:.2f} s), "
                 f"p {results['p'].result} ({results['p'].status}); broker: {record}")
        return case

    def _malformed(self) -> list[dict]:
        """Bad kvpush parameters straight to D (and a few to P): each answered in time, nothing wrong, the engine keeps serving."""
        tid = new_transfer_id
        timeout_ms = self.settings.timeout_ms
        valid = {"role": "decode", "attempt": 1, "prefill_engine_id": PREFILL_ID, "timeout_ms": timeout_ms}
        to_decode: list[tuple[str, Any]] = [
            ("not-an-object", "x"),
            ("no-transfer-id", {"role": "decode", "prefill_engine_id": PREFILL_ID}),
            ("bad-transfer-id", {**valid, "transfer_id": "bad id!"}),
            ("long-transfer-id", {**valid, "transfer_id": "x" * 129}),
            ("attempt-zero", {**valid, "transfer_id": tid(), "attempt": 0}),
            ("attempt-string", {**valid, "transfer_id": tid(), "attempt": "1"}),
            ("attempt-huge", {**valid, "transfer_id": tid(), "attempt": 2**40}),
            ("timeout-negative", {**valid, "transfer_id": tid(), "timeout_ms": -5}),
            ("timeout-huge", {**valid, "transfer_id": tid(), "timeout_ms": 10**12}),
            ("timeout-string", {**valid, "transfer_id": tid(), "timeout_ms": "5000"}),
            ("no-prefill-engine", {"role": "decode", "transfer_id": tid(), "timeout_ms": timeout_ms}),
            ("unknown-prefill-engine", {**valid, "transfer_id": tid(), "prefill_engine_id": "no-such-engine"}),
            ("decode-engine-as-prefill", {**valid, "transfer_id": tid(), "prefill_engine_id": DECODE_ID}),
            ("bad-role", {**valid, "transfer_id": tid(), "role": "bogus"}),
            ("other-control-plane", {**valid, "transfer_id": tid(), "control_plane": "10.255.255.1:1"}),
            ("bad-traceparent", {**valid, "transfer_id": tid(), "traceparent": 12}),
            ("prefill-role-to-decode", {"role": "prefill", "transfer_id": tid(), "decode_engine_id": DECODE_ID, "timeout_ms": timeout_ms}),
        ]
        to_prefill: list[tuple[str, Any]] = [
            ("not-an-object", "x"),
            ("bad-transfer-id", {"role": "prefill", "transfer_id": "bad id!", "decode_engine_id": DECODE_ID}),
            ("decode-role-to-prefill", {**valid, "transfer_id": tid()}),
            ("unknown-decode-engine", {"role": "prefill", "transfer_id": tid(), "decode_engine_id": "no-such-engine", "timeout_ms": timeout_ms}),
        ]
        prompt_index = PROMPT_LENGTHS.index(129)
        results = []
        for role, cases, max_tokens in (("decode", to_decode, 4), ("prefill", to_prefill, 1)):
            for name, params in cases:
                outcome = self._direct(role, prompt_index, max_tokens, {"kvpush": params}, f"malformed-{role}-{name}")
                results.append({"engine": role, "case": name, "status": outcome.status, "result": outcome.result, "elapsed_s": outcome.elapsed_s,
                                "detail": outcome.detail[:160]})
                self.log(f"malformed {role} {name}: {outcome.result} ({outcome.status}) in {outcome.elapsed_s:.2f} s")
        return results


def _broker_record(stack: Stack, transfer_id: str) -> dict[str, Any]:
    """The broker's record of a transfer's latest attempt (state, end reason), or the error that prevented reading it."""

    async def fetch() -> dict[str, Any]:
        config = ClientConfig(target=stack.broker_address, token=stack.router_token, default_timeout_s=3.0)
        async with ShardedBrokerClient(config) as broker:
            transfer = (await broker.get_transfer(rv_pb.GetTransferRequest(transfer_id=transfer_id))).transfer
        return {
            "attempt": transfer.key.attempt,
            "state": transfer_pb2.TransferState.Name(transfer.state),
            "end_reason": transfer_pb2.EndReason.Name(transfer.end_reason),
            "detail": transfer.detail[:200],
        }

    try:
        return asyncio.run(fetch())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


