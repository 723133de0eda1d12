# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The control-plane memory soak: many transfer attempts in flight at once, then memory back near its baseline."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from bench.chaos.log import Log
from bench.chaos.settings import SOAK_DECODE_ID, SOAK_PREFILL_ID, Settings
from bench.chaos.stack import Stack
from kvpush.client import BrokerClient, ClientConfig, RegistrarClient
from kvpush.dev import sample_engines as sample
from kvpush.processes import pss_bytes, rss_bytes
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb

# Soak: "near its baseline" means back within this much of the RSS before, or within this share of the peak's growth.
SOAK_RSS_SLACK_BYTES = 16 * 1024 * 1024
SOAK_RSS_SLACK_SHARE = 0.25


async def soak(target: str, tokens: dict[str, str], attempts: int, timeout_s: float, settle_s: float,
               probe: Callable[[], dict[str, Any]], log: Log, label: str) -> dict[str, Any]:
    """Holds ~`attempts` transfer attempts in flight at once at one control plane, lets them end, waits settle_s; returns the samples.

    Two fake engines register one rank each with their own tokens and keep
    their leases; a third of the attempts only registers a destination, a
    third only reports prefill done, a third does both, so the broker sends
    the fake producer a write order that is never answered (the attempt
    ends at its deadline and is fenced by its time bound).
    """
    configs = {engine_id: ClientConfig(target=target, token=tokens[engine_id], default_timeout_s=10.0) for engine_id in (SOAK_PREFILL_ID, SOAK_DECODE_ID)}
    incarnation = "soak-" + os.urandom(4).hex()
    samples: dict[str, Any] = {"before": probe()}
    peak: dict[str, Any] = {}
    errors: collections.Counter[str] = collections.Counter()
    orders = 0
    background: list[asyncio.Task] = []
    registrars = {engine_id: RegistrarClient(config) for engine_id, config in configs.items()}
    brokers = {engine_id: BrokerClient(config) for engine_id, config in configs.items()}
    leases: dict[str, str] = {}
    try:
        for engine_id, role in ((SOAK_PREFILL_ID, sample_role(True)), (SOAK_DECODE_ID, sample_role(False))):
            request = sample.rank_request(engine_id, role, incarnation=incarnation, num_blocks=100_000, lease_ttl_s=10.0)
            leases[engine_id] = (await registrars[engine_id].register_engine_rank(request)).lease_id

        async def keep_alive(engine_id: str) -> None:
            stream = registrars[engine_id].keep_alive()
            async with stream:
                await stream.write(reg_pb.KeepAliveRequest(lease_ids=[leases[engine_id]]))
                async for _ in stream:
                    await asyncio.sleep(2.0)
                    await stream.write(reg_pb.KeepAliveRequest(lease_ids=[leases[engine_id]]))

        async def consume_orders() -> None:
            nonlocal orders
            request = rv_pb.StreamWriteOrdersRequest(engine_id=SOAK_PREFILL_ID, incarnation=incarnation, early_orders=False)
            async with brokers[SOAK_PREFILL_ID].stream_write_orders(request) as stream:
                async for message in stream:
                    if message.WhichOneof("message") == "order":
                        orders += 1

        async def sampler() -> None:
            while True:
                now = await asyncio.to_thread(probe)
                for key, value in now.items():
                    if isinstance(value, (int, float)) and (key not in peak or value > peak[key]):
                        peak[key] = value
                    elif isinstance(value, dict):
                        inner = peak.setdefault(key, {})
                        for k, v in value.items():
                            inner[k] = max(inner.get(k, v), v)
                await asyncio.sleep(0.25)

        background = [asyncio.create_task(keep_alive(e)) for e in configs] + [asyncio.create_task(consume_orders()), asyncio.create_task(sampler())]
        await asyncio.sleep(0.5)
        gate = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            transfer_id = f"soak-{incarnation}-{i}"
            kind = i % 3
            first_block = (i * 4) % 99_000
            kwargs = {"num_tokens": 40, "first_block": first_block, "timeout_s": timeout_s, "incarnation": incarnation}
            destination = sample.destination_request(transfer_id, decode_engine_id=SOAK_DECODE_ID, prefill_engine_id=SOAK_PREFILL_ID, **kwargs)
            prefill_done = sample.prefill_done_request(transfer_id, prefill_engine_id=SOAK_PREFILL_ID, decode_engine_id=SOAK_DECODE_ID, **kwargs)
            async with gate:
                try:
                    if kind in (0, 2):
                        await brokers[SOAK_DECODE_ID].register_destination(destination)
                    if kind in (1, 2):
                        await brokers[SOAK_PREFILL_ID].report_prefill_done(prefill_done)
                except Exception as exc:
                    errors[type(exc).__name__ + ": " + str(exc)[:80]] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(attempts)))
        launched_s = time.monotonic() - t0
        log(f"soak {label}: {attempts} attempts sent in {launched_s:.1f} s ({sum(errors.values())} errors); waiting for them to end")
        await asyncio.sleep(1.0)
        samples["in_flight"] = await asyncio.to_thread(probe)
        # Every attempt ends at its deadline; the matched ones are fenced by their time bound after it.
        end_by = time.monotonic() + timeout_s + 30.0
        while time.monotonic() < end_by:
            now = await asyncio.to_thread(probe)
            if now.get("live_attempts") == 0:
                break
            await asyncio.sleep(0.5)
        samples["ended"] = await asyncio.to_thread(probe)
        samples["ended_after_s"] = round(time.monotonic() - t0, 1)
        for engine_id, lease in leases.items():
            with contextlib.suppress(Exception):
                await registrars[engine_id].deregister_engine_rank(reg_pb.DeregisterEngineRankRequest(lease_id=lease))
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for client in (*registrars.values(), *brokers.values()):
            with contextlib.suppress(Exception):
                await client.close()
    log(f"soak {label}: every attempt ended; waiting {settle_s:g} s for the broker's retention to pass")
    await asyncio.sleep(settle_s)
    samples["after"] = await asyncio.to_thread(probe)
    samples["peak"] = peak
    samples["orders_received"] = orders
    samples["errors"] = dict(errors)
    samples["attempts"] = attempts
    return samples


def sample_role(prefill: bool) -> int:
    return sample.PREFILL if prefill else sample.DECODE


async def soak_both(stack: Stack, settings: Settings, log: Log) -> dict[str, Any]:
    """The soak against the stack's control plane (RSS, PSS, live-attempts gauge) and, at once, an in-process one (memory_sizes)."""
    from kvpush.services import control_plane
    from kvpush.services.common.config import ServerConfig
    from kvpush.services.common.tokens import load_tokens_dir

    tokens = {path.name: path.read_text().strip() for path in stack.cp.tokens_dir.iterdir() if path.is_file()}
    pid = stack.cp.process.pid

    def external() -> dict[str, Any]:
        return {"rss_bytes": rss_bytes(pid), "pss_bytes": pss_bytes(pid), "live_attempts": stack.broker_gauge(),
                "pending_registrations": stack.broker_gauge("kvpush_broker_pending_registrations"),
                "pending_prefill_dones": stack.broker_gauge("kvpush_broker_pending_prefill_dones")}

    async with control_plane.running(ServerConfig(listen="127.0.0.1:0"), tokens=load_tokens_dir(stack.cp.tokens_dir)) as plane:

        def internal() -> dict[str, Any]:
            return {"live_attempts": plane.broker.live_attempts, "memory_sizes": plane.broker.memory_sizes}

        out_ext, out_int = await asyncio.gather(
            soak(stack.cp.address, tokens, settings.soak_attempts, settings.soak_timeout_s, settings.soak_settle_s, external, log, "external"),
            soak(f"127.0.0.1:{plane.port}", tokens, settings.soak_attempts, settings.soak_timeout_s, settings.soak_settle_s, internal, log, "in-process"),
        )
    return {"external": out_ext, "in_process": out_int}


def soak_verdict(result: dict[str, Any]) -> dict[str, Any]:
    ext, internal = result["external"], result["in_process"]
    before, peak, after = ext["before"]["rss_bytes"], ext["peak"].get("rss_bytes", 0), ext["after"]["rss_bytes"]
    allowed = before + max(SOAK_RSS_SLACK_BYTES, SOAK_RSS_SLACK_SHARE * max(0, peak - before))
    sizes_before, sizes_after = internal["before"]["memory_sizes"], internal["after"]["memory_sizes"]
    checks = {
        "peak_live_attempts": ext["peak"].get("live_attempts"),
        "live_attempts_after": ext["after"].get("live_attempts"),
        "rss_before_mib": round(before / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "rss_allowed_after_mib": round(allowed / 2**20, 1),
        "pss_before_mib": round(ext["before"]["pss_bytes"] / 2**20, 1),
        "pss_peak_mib": round(ext["peak"].get("pss_bytes", 0) / 2**20, 1),
        "pss_after_mib": round(ext["after"]["pss_bytes"] / 2**20, 1),
        "memory_sizes_before": sizes_before,
        "memory_sizes_peak": internal["peak"].get("memory_sizes"),
        "memory_sizes_after": sizes_after,
    }
    checks["rss_back_near_baseline"] = after <= allowed
    checks["tables_back_to_baseline"] = sizes_after == sizes_before
    checks["live_attempts_back_to_zero"] = ext["after"].get("live_attempts") == 0 and internal["after"]["live_attempts"] == 0
    checks["passed"] = checks["rss_back_near_baseline"] and checks["tables_back_to_baseline"] and checks["live_attempts_back_to_zero"]
    return checks
