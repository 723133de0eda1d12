# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Chaos with real processes: the local kvpush stack under steady mixed load while faults are injected.

    python -m bench.chaos --long [--json runs/chaos.json]     # every fault, minutes of load each, the memory soak
    python -m bench.chaos                                     # the short form (what tests/e2e/test_chaos.py runs)
    python -m bench.chaos --faults p-kill,proxy-cut --pre 20 --post 20

Starts, on 127.0.0.1 only: `kvpush control-plane` (a --tokens-dir with one
token per identity, a --metrics-port), a TCP proxy in front of it
(bench/tcp_proxy.py) that only the prefill engine uses, one prefill (P,
CPU 0) and one decode (D, CPU 1) vLLM CPU engine with KvpushConnector, and
`kvpush router` (push mode). An ordinary single engine runs once at the
start for the reference outputs and is stopped. Several client threads then
send steady mixed load through the router (prompts of 5 to 2,000 tokens,
1 to 16 greedy tokens, streamed and not) while the faults below are
injected one after another; after each, the run waits until the router
serves again, keeps the load on, stops it, and waits until every KV block
of P and D is free.

Faults (`--faults`, in this order with --long):

  p-kill      kill -9 of P's process group, then P restarted (same engine id and port, a new incarnation)
  d-kill      the same for D
  cp-kill     kill -9 of the control plane, then restarted on the same port with the same tokens dir (it loses all state)
  p-stop      SIGSTOP of P's process group for longer than its lease TTL, then SIGCONT
  proxy-cut   the proxy between P and the control plane closes every connection and refuses new ones, then heals (NIXL stays up)
  disconnects clients close their HTTP connection at random times mid-request
  collide     two decode requests sent straight to D sharing one (transfer_id, attempt), plus the matching prefill leg; and
              malformed kvpush parameters sent straight to D (and P)

Each request through the router is counted once, under the fault phase it
started in: ok (tokens equal the reference's), failed (HTTP status and the
router's `reason`), hung (no answer by its deadline + 5 s), wrong (a 200
whose tokens differ from the reference), or disconnected (the client hung
up on purpose). A request's deadline is the router's --transfer-timeout-ms:
`kvpush router` takes no per-request timeout (a client's kv_transfer_params
is refused), it sends that flag's value as `timeout_ms` on both legs.

The soak (--long, or --soak N) registers two fake engine ranks with their
own tokens and holds ~N transfer attempts in flight at once at the stack's
control plane over gRPC (kvpush.client), a third waiting for prefill, a
third for registration and a third matched with orders nobody answers; it
reports the control plane's RSS and PSS and the kvpush_broker_live_attempts
gauge before, at the peak and after every attempt ended and the broker's
retention passed. The same soak runs against an in-process control plane
(kvpush.services.control_plane.running) for BrokerCore.memory_sizes.

Every process is stopped by its process group, also on Ctrl-C; every wait
is bounded. Logs and the JSON result go to runs/chaos-<timestamp>/.
"""
