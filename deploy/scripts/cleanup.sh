#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# Stops what serve_pd.sh (server) or run_sweep.sh (proxy) started on this node, by the PIDs they recorded.
#
#   ./cleanup.sh server    # on each GPU node: the vLLM server(s) serve_pd.sh started
#   ./cleanup.sh proxy     # on the proxy / benchmark node: the router run_sweep.sh started
set -euo pipefail

PID_DIR=${PID_DIR:-/tmp/kvpush-bench}
GRACE_S=${GRACE_S:-30}

case "${1:-}" in
  server) pid_files=("$PID_DIR"/serve_prefill.pid "$PID_DIR"/serve_decode.pid) ;;
  proxy) pid_files=("$PID_DIR"/router.pid) ;;
  *) echo "usage: cleanup.sh server|proxy" >&2; exit 2 ;;
esac

# A process that exited but was not yet reaped by its parent (a zombie) counts as gone.
alive() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ "$state" != Z* ]]
}

for pid_file in "${pid_files[@]}"; do
  [[ -f "$pid_file" ]] || continue
  pid=$(cat "$pid_file")
  if ! alive "$pid"; then
    rm -f "$pid_file"
    continue
  fi
  # vLLM's engine core and workers are children of the API server: stop the whole process group
  # when the server leads one (a shell job does), else the server, whose shutdown ends its children.
  pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
  if [[ "$pgid" == "$pid" ]]; then target=(-- "-$pid"); else target=("$pid"); fi
  echo "cleanup.sh: stopping $(basename "$pid_file" .pid) (pid $pid)"
  kill -TERM "${target[@]}" 2>/dev/null || true
  for _ in $(seq "$((GRACE_S * 10))"); do
    alive "$pid" || break
    sleep 0.1
  done
  if alive "$pid"; then
    echo "cleanup.sh: pid $pid still alive after ${GRACE_S}s, killing"
    kill -KILL "${target[@]}" 2>/dev/null || true
  fi
  rm -f "$pid_file"
done
