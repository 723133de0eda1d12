# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The push-vs-pull sweep on this machine: kvpush, upstream NixlPushConnector and upstream NixlConnector (pull).

Reproduces the study in /work/shared/seed (TTFT and TPOT against QPS, one
panel per input length) with three P/D stacks of the same tiny model and the
same engine flags (kvpush.dev.localstack.engines; prefix caching off on P and D),
every P pinned to CPU 0 and every D to CPU 1:

* kvpush: `KvpushConnector` on both engines, the kvpush control plane and
  `kvpush router --mode push`;
* upstream-push: `NixlPushConnector`, `kvpush router --mode upstream-push`;
* pull: `NixlConnector`, `kvpush router --mode pull` (P leg, then D leg).

Upstream engines run with the NIXL progress thread's spin removed (a 1 ms
poll delay, bench/engine_hooks) unless `--nixl-as-shipped`. With
`--vllm-spin-ms`, every engine of every mode has vLLM's shared-memory queue
spin (1 s after each read, ~95 % of an engine's CPU here) cut to that long
per wait.

Load: per point (input length, QPS, output length, iteration) the same
prompts and the same Poisson arrival times for every mode, streamed
completions through the mode's router. Per request: TTFT (client send →
first streamed token), TPOT ((last − first token) / (n − 1)), inter-token
latencies, end-to-end latency. By default all stacks are up at once and the
modes alternate at every point, in an order that rotates from point to
point, so machine drift hits all of them; the CPU every stack used during
each run is recorded, so the idle stacks' interference shows (an idle
upstream engine still wakes ~1,000 times a second). With
`--one-stack-at-a-time` (forced by `--nixl-as-shipped`, whose idle engines
each burn a core) only one mode's stack runs: the modes alternate per pass
over the points instead, one stack start per mode and pass.

Every run is checked: a sample of its requests must give the greedy token
ids of a single ordinary engine (`kvpush.dev.localstack.engines.reference_run`, computed up front)
with logprobs within 1e-3, and the KV must have moved: kvpush, the broker's
`bytes_written` per transfer equals the whole 128-token blocks of every prompt token but the last ×
2,048 B/token (2 layers × K and V × 2 KV heads × 64 × 4 B); upstream, the
`vllm:nixl_bytes_transferred` histograms of P and D (sum and count deltas)
give one transfer and the prompt's bytes per request. For kvpush each run
also gets the per-segment TTFT breakdown from its spans (`kvpush.report`);
for every mode the router-side P leg and the engines' vLLM histograms
(queue, prefill, decode time) beside it.

One JSON per run: `<results-dir>/<mode>_qps<q>_in<in>_out<out>_iter<i>.json`
(every request's figures and the summary), plus `summary.json` (every run's
summary and the tables) and `points.json` (the tables' figures only). Then

    python -m bench.sweep --quick --results-dir runs/sweep-quick
    python -m bench.sweep --results-dir runs/sweep            # the full grid
    python -m bench.sweep --results-dir runs/sweep --report-only --markdown runs/sweep/report.md
    python bench/plot_sweep.py --results-dir runs/sweep --metric ttft --log-y
"""
