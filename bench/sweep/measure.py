# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What is measured around a run: the engines' vLLM histograms, the KV each transfer moved, spans and CPU per thread."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from bench.sweep.grid import Point
from bench.sweep.stacks import ModeStack
from kvpush.dev.localstack.control_plane import ControlPlaneHandle
from kvpush.dev.localstack.metrics import scrape_metrics
from kvpush.layout.geometry import window_first_token
from kvpush.report.breakdown import breakdown
from kvpush.telemetry import FIRST_TOKEN_EVENT, trace_id_ratio_sampled

# Tiny-model geometry (kvpush.dev.tinymodel): 2 layers × K and V × 2 KV heads × 64
# channels × 4 bytes (float32) per token; vLLM CPU's block size.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
BLOCK_SIZE = 128


@dataclasses.dataclass(frozen=True)
class KvGeometry:
    """What one token's KV weighs across the model's layers, and the block size vLLM-CPU runs it with.

    A hybrid adds a sliding-window group (its layers move only the blocks of
    the window D's first decode step reads) or state layers (a fixed number
    of bytes per request).
    """

    block_size: int
    bytes_per_token: int  # of the layers that keep every token
    window: int = 0  # the sliding-window group's window, 0 without one
    window_bytes_per_token: int = 0  # of the sliding-window layers
    state_bytes: int = 0  # every state layer's whole state, per request


DENSE_GEOMETRY = KvGeometry(BLOCK_SIZE, KV_BYTES_PER_TOKEN)
FLOAT32 = 4  # the tiny models' KV and state dtype


def kv_geometry(config: dict) -> KvGeometry:
    """A tiny model's geometry from its config.json: an MLA latent (16-token blocks on vLLM-CPU), dense K and V, or a hybrid's."""
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        return KvGeometry(16, layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * FLOAT32)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layer_bytes = 2 * config["num_key_value_heads"] * head_dim * FLOAT32
    if "layer_types" in config:  # sliding-window hybrid (Gemma 3)
        sliding = config["layer_types"].count("sliding_attention")
        return KvGeometry(BLOCK_SIZE, (layers - sliding) * layer_bytes, config["sliding_window"], sliding * layer_bytes)
    if "hybrid_override_pattern" in config:  # Mamba2 hybrid (Nemotron-H): "M" Mamba2, "*" attention, "-" MLP layers
        pattern = config["hybrid_override_pattern"]
        channels = config["mamba_num_heads"] * config["mamba_head_dim"] + 2 * config["n_groups"] * config["ssm_state_size"]
        state = ((config["conv_kernel"] - 1) * channels + config["mamba_num_heads"] * config["mamba_head_dim"] * config["ssm_state_size"]) * FLOAT32
        return KvGeometry(BLOCK_SIZE, pattern.count("*") * layer_bytes, state_bytes=pattern.count("M") * state)
    return KvGeometry(BLOCK_SIZE, layers * layer_bytes)


# vLLM's per-engine histograms read around every run (sum and count deltas).
ENGINE_HISTOGRAMS = {
    "nixl_bytes": "vllm:nixl_bytes_transferred",
    "nixl_transfer_s": "vllm:nixl_xfer_time_seconds",
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "ttft_s": "vllm:time_to_first_token_seconds",
}
SPANS_SETTLE_TIMEOUT_S = 10.0


def histogram_totals(url: str) -> dict[str, dict[str, float]]:
    """Sum and count of each ENGINE_HISTOGRAMS entry on one engine (absent ones are 0)."""
    samples = scrape_metrics(url)
    totals = {}
    for key, name in ENGINE_HISTOGRAMS.items():
        totals[key] = {part: sum(v for _, v in samples.get(f"{name}_{part}", [])) for part in ("sum", "count")}
    return totals


def histogram_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per histogram: sum and count over the run and their mean (ms for times, bytes for sizes)."""
    delta = {}
    for key in ENGINE_HISTOGRAMS:
        total = after[key]["sum"] - before[key]["sum"]
        count = after[key]["count"] - before[key]["count"]
        scale = 1.0 if key == "nixl_bytes" else 1000.0
        delta[key] = {"sum": total, "count": count, "mean": total / count * scale if count else None}
    return delta


def expected_kv_bytes(tokens: int, geometry: KvGeometry = DENSE_GEOMETRY) -> int:
    """The KV a transfer of this many prompt tokens moves: their blocks, whole (kvpush writes a last partly filled block whole too).

    Upstream moves every prompt token; kvpush every one but the last, which
    D computes itself in either case.
    """
    blocks = -(-tokens // geometry.block_size)
    full = blocks * geometry.block_size * geometry.bytes_per_token
    window_blocks = blocks - window_first_token(0, tokens, geometry.block_size, geometry.window) // geometry.block_size if geometry.window else 0
    return full + window_blocks * geometry.block_size * geometry.window_bytes_per_token + geometry.state_bytes


async def fetch_transfers(control_plane: ControlPlaneHandle, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    """The broker's record of each (transfer_id, attempt); errors are returned in place of a record."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    results: dict[tuple[str, int], Any] = {}
    async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
        for transfer_id, attempt in keys:
            try:
                response = await broker.get_transfer(pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))
                results[(transfer_id, attempt)] = response.transfer
            except Exception as exc:  # recorded per transfer; one failed query must not end the sweep
                results[(transfer_id, attempt)] = exc
    return results


def wait_for_spans(stack: ModeStack, offset: int, prefix: str, expected: int, need_engine_spans: bool,
                   trace_ratio: float | None = None) -> list[dict[str, Any]]:
    """The spans written since `offset` once `expected` served router requests of `prefix` are there and, for kvpush's
    engine spans, every request the engines sample (all of them unless `trace_ratio`) is complete; bounded."""
    deadline = time.monotonic() + SPANS_SETTLE_TIMEOUT_S
    while True:
        spans = stack.spans.read_since(offset)
        requests = breakdown(spans, request_id_prefix=prefix).requests
        sampled = [r for r in requests if trace_ratio is None or trace_id_ratio_sampled(r.trace_id, trace_ratio)]
        if len(requests) >= expected and (not need_engine_spans or all(r.complete for r in sampled)) or time.monotonic() > deadline:
            return spans
        time.sleep(0.3)


def router_segments(spans: list[dict[str, Any]], prefix: str) -> dict[str, dict[str, float | None]]:
    """Router-side timings per request of `prefix` (ms): P leg, router TTFT and what follows the P leg's answer."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    per_request: dict[str, dict[str, float | None]] = {}
    for root in spans:
        if root["name"] != "router.request" or not str(root["attributes"].get("kvpush.client_request_id", "")).startswith(prefix):
            continue
        attempt = int(root["attributes"].get("kvpush.attempt", 0))
        legs = {s["name"]: s for s in by_trace[root["trace_id"]] if s["name"] in ("router.prefill_leg", "router.decode_leg")
                and int(s["attributes"].get("kvpush.attempt", attempt)) == attempt}
        first = [e["time_ns"] for e in root["events"] if e["name"] == FIRST_TOKEN_EVENT]
        prefill = legs.get("router.prefill_leg")
        decode = legs.get("router.decode_leg")
        ttft = (first[0] - root["start_ns"]) / 1e6 if first else None
        p_leg = (prefill["end_ns"] - root["start_ns"]) / 1e6 if prefill else None
        per_request[root["attributes"]["kvpush.client_request_id"]] = {
            "router_ttft_ms": ttft,
            "p_leg_ms": p_leg,
            "after_p_leg_ms": None if ttft is None or p_leg is None else ttft - p_leg,
            "d_leg_sent_ms": (decode["start_ns"] - root["start_ns"]) / 1e6 if decode else None,
            "attempt": attempt,
        }
    return per_request



# Threads below this are left out: /proc counts CPU in 10 ms ticks, 0.1-0.2 ms per request over a run's 48-96 requests.
THREAD_FLOOR_MS = 0.25


def thread_breakdown(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """CPU ms per completed request of each "<process>/<thread>" name that used at least THREAD_FLOOR_MS per request."""
    used = {name: (seconds - before.get(name, 0.0)) * 1000 / completed for name, seconds in after.items()}
    return dict(sorted(((n, round(ms, 2)) for n, ms in used.items() if ms >= THREAD_FLOOR_MS), key=lambda item: -item[1]))


def kvpush_breakdown(spans: list[dict[str, Any]], prefix: str, wall_minus_monotonic_ns: int, trace_ratio: float | None = None) -> dict[str, Any]:
    """kvpush.report's per-segment breakdown of the run (p50/p90/mean per segment, ms), and each request's D wait tail on CLOCK_MONOTONIC.

    With `trace_ratio` it reads only the traces the engines sampled, as if the
    router sampled at that ratio too (the report's input in such a deployment).

    The wait tails (KV in at D, D scheduled; seconds) are where
    `bench.step_timeline` finds the engine steps each one spans; spans carry
    wall-clock times, the step timeline CLOCK_MONOTONIC.
    """
    if trace_ratio is not None:
        spans = [s for s in spans if trace_id_ratio_sampled(s["trace_id"], trace_ratio)]
    result = breakdown(spans, request_id_prefix=prefix)
    rows = {row.name: {"p50": row.p50, "p90": row.p90, "mean": row.mean, "n": row.count} for row in result.rows() + result.detail_rows()}
    tails = [[(r.instants["kv_received"] - wall_minus_monotonic_ns) / 1e9, (r.instants["d_scheduled"] - wall_minus_monotonic_ns) / 1e9]
             for r in result.requests if r.instants["kv_received"] is not None and r.instants["d_scheduled"] is not None]
    return {"requests": len(result.requests), "complete": sum(r.complete for r in result.requests), "excluded": result.excluded,
            "clamped": sum(r.clamped for r in result.requests), "rows": rows, "d_wait_tails_monotonic_s": tails}


def missing_kv_bytes(tokens: int, shared_tokens: int, geometry: KvGeometry = DENSE_GEOMETRY) -> int:
    """What a transfer of this many prompt tokens moves when D's prefix cache holds the shared prefix's whole blocks."""
    cached = shared_tokens // geometry.block_size * geometry.block_size
    return expected_kv_bytes(tokens, geometry) - cached * geometry.bytes_per_token


def kvpush_kv_check(stack: ModeStack, spans: list[dict[str, Any]], prefix: str, point: Point, shared_tokens: int = 0,
                    geometry: KvGeometry = DENSE_GEOMETRY) -> dict[str, Any]:
    """The broker's bytes_written of every transfer of the run against the prompt's whole blocks.

    With a shared prefix of `shared_tokens`, a transfer moves either every
    block (D had not cached the prefix yet: the run's first requests) or
    only the blocks D lacks; at least one must be the latter.
    """
    roots = [s for s in spans if s["name"] == "router.request" and str(s["attributes"].get("kvpush.client_request_id", "")).startswith(prefix)]
    keys = [(s["attributes"].get("kvpush.transfer_id", ""), int(s["attributes"].get("kvpush.attempt", 1))) for s in roots]
    transfers = asyncio.run(fetch_transfers(stack.control_plane, [k for k in keys if k[0]]))
    full = expected_kv_bytes(point.input_len - 1, geometry)
    expected = missing_kv_bytes(point.input_len - 1, shared_tokens, geometry)
    written = [t.bytes_written for t in transfers.values() if not isinstance(t, Exception)]
    errors = [str(t)[:200] for t in transfers.values() if isinstance(t, Exception)]
    return {
        "source": "broker GetTransfer(...).bytes_written",
        "expected_per_request": expected,
        "bytes_per_request": sum(written) / len(written) if written else None,
        "transfers": len(transfers),
        "matching": sum(b == expected for b in written),
        "whole_prompt": sum(b == full for b in written) if shared_tokens else 0,
        "distinct_values": sorted(set(written)),
        "query_errors": errors[:3],
        "ok": bool(written) and all(b in (expected, full) for b in written) and expected in written and not errors,
    }


def upstream_kv_check(engines: dict[str, dict[str, dict[str, float | None]]], requests: int, point: Point, shared_tokens: int = 0,
                      geometry: KvGeometry = DENSE_GEOMETRY) -> dict[str, Any]:
    """NIXL bytes over the run (P and D `vllm:nixl_bytes_transferred`): one transfer of the prompt's blocks per request.

    With a shared prefix, each transfer moves between the blocks D lacks and every block.
    """
    total = sum(d["nixl_bytes"]["sum"] for d in engines.values())
    count = sum(d["nixl_bytes"]["count"] for d in engines.values())
    full = expected_kv_bytes(point.input_len, geometry)
    expected = missing_kv_bytes(point.input_len, shared_tokens, geometry)
    per_request = total / requests if requests else None
    return {
        "source": "vllm:nixl_bytes_transferred sum/count deltas on P and D",
        "expected_per_request": expected,
        "bytes_per_request": per_request,
        "transfers": count,
        "transfers_per_request": count / requests if requests else None,
        "ok": requests > 0 and count == requests and per_request is not None and expected <= per_request <= full,
    }
