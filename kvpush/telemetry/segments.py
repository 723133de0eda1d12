# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The Prometheus form of TTFT's critical path: one histogram family that router, P and D each feed with the segments they see.

The segments are those of `kvpush ttft-report` (`kvpush.report.breakdown.SEGMENTS`),
in chain order, so their p50s stacked come to TTFT's p50 without a trace
pipeline. Each is observed by the process that sees its end; where the
start is another process's instant it travels with the request (P tells
the router when its prefill leg arrived), and on one host wall clocks
agree. Two segments end at nearby instants rather than the trace's: P's
WRITE ends when P sees its completion (the trace: D's last notification),
and D's output ends when D's API server has the token (the trace: the
router read it; the rest, D's HTTP answer, is left out).
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
PREFILL_SEGMENTS = ("p_queue", "p_prefill", "handoff", "write_transfer")
DECODE_SEGMENTS = ("d_wait_tail", "d_first_decode_step", "d_output")

# Fine enough that a p50 read off a bucket (Prometheus interpolates within it) is within a few percent: the
# segments run from a fraction of a millisecond (a hand-off) to the queueing of an overloaded engine.
SEGMENT_BUCKETS = (
    0.00025, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005,
    0.006, 0.007, 0.008, 0.009, 0.010, 0.011, 0.0125, 0.014, 0.016, 0.018, 0.020, 0.0225, 0.025, 0.0275, 0.030,
    0.035, 0.040, 0.045, 0.050, 0.060, 0.070, 0.080, 0.090, 0.100, 0.125, 0.150, 0.175, 0.200, 0.250, 0.300,
    0.400, 0.500, 0.750, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
)
