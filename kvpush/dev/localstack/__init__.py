# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The local stack on this machine: control plane, vLLM engines and router as child processes, for the demo, the benchmarks and the tests.

`stack` starts a whole stack of any mode; `process`, `engines`,
`control_plane`, `router` and `upstream` start its parts; `completions`,
`metrics`, `prompts` and `transfers` talk to them. Everything listens on
127.0.0.1, takes free ports, runs in its own process group, is stopped by
group, and every wait is bounded.
"""
