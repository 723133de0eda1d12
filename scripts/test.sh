#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# Builds .venv (once per change of pyproject.toml or the setup scripts) and runs the whole test suite.
#
#   scripts/test.sh                   # everything under tests/ (what CI runs)
#   scripts/test.sh --fast            # the fast tier: no engine, NIXL, torch, etcd or browser (tests/conftest.py)
#   scripts/test.sh tests/client -x   # arguments go to pytest instead of "tests"
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SETUP_LOG_NAME=test.sh
source scripts/setup-env.sh
if [[ "${1:-}" == "--fast" ]]; then
  setup_env
  log "running pytest, fast tier"
  shift
  exec "$PYTHON" -m pytest -q --fast "${@:-tests}"
fi
setup_env --with-browser --with-etcd --with-prometheus

log "running pytest"
if [[ $# -eq 0 ]]; then
  set -- tests
fi
status=0
"$PYTHON" -m pytest -ra "$@" || status=$?
log "pytest exited with $status"
exit "$status"
