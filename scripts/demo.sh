#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# One command on a fresh machine: installs what kvpush needs (.venv, see scripts/setup-env.sh),
# then runs `kvpush demo`: control plane, P and D vLLM CPU engines, router, a few requests,
# the TTFT breakdown, and a report in runs/demo-<timestamp>/.
#
#   scripts/demo.sh                   # arguments go to `kvpush demo` (see --help)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SETUP_LOG_NAME=demo.sh
source scripts/setup-env.sh
setup_env

log "running kvpush demo"
exec "$PYTHON" -m kvpush.cli demo "$@"
