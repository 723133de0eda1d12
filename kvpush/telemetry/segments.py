# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The Prometheus form of TTFT's critical path: one histogram family that router, P and D each feed with the segments they see.

The segments are those of `kvpush ttft-report` (`kvpush.report.breakdown.SEGMENTS`),
in chain order, so their p50s stacked come to TTFT's p50 without a trace
pipeline. Each is observed by the process that sees its end; where the
start is another process's instant it travels with the request (P's
answer tells the router when its prefill leg arrived, a notification
after the WRITE tells D when it was posted), and on one host wall clocks
agree. One segment ends near, not at, the trace's instant: D's output ends
when D's API server has the token (the trace: when the router read it; D's
HTTP answer in between is in no segment).
"""

from __future__ import annotations

SEGMENT_METRIC = "kvpush_ttft_segment_seconds"
SEGMENT_HELP = "Critical-path segments of time to first token (label segment, in chain order: see docs/observability.md)"

# A prefill leg's answer carries when P's vLLM received it (wall ns), at
# kv_transfer_params[TIMING_PARAMS][PREFILL_ARRIVAL_NS]: the end of router_to_p. A key of its own, not "kvpush":
# a router that passes P's kv_transfer_params on to D (as pull-mode proxies do) sends D nothing it would refuse.
TIMING_PARAMS = "kvpush_timing"
PREFILL_ARRIVAL_NS = "prefill_arrival_ns"

# Which process observes which segment.
ROUTER_SEGMENTS = ("router_to_p", "router_overhead")
PREFILL_SEGMENTS = ("p_queue", "p_prefill", "handoff")
DECODE_SEGMENTS = ("write_transfer", "d_wait_tail", "d_first_decode_step", "d_output")



def _geometric(start: float, stop: float, factor: float) -> list[float]:
    bounds, bound = [], start
    while bound < stop * (1 - 1e-9):
        bounds.append(float(f"{bound:.3g}"))
        bound *= factor
    return bounds


# Bounds 8 % apart from 1 to 200 ms, where TTFT and most segments of an unloaded pair fall: Prometheus reads a
# quantile by interpolating inside a bucket, so a p50 is off by at most half a bucket's width (4 %) there.
# Coarser below (sub-millisecond hand-offs) and above (queueing of an overloaded engine, up to a minute).
SEGMENT_BUCKETS = tuple(_geometric(0.0001, 0.001, 1.25) + _geometric(0.001, 0.2, 1.08) + _geometric(0.2, 60.0, 1.3) + [60.0])
