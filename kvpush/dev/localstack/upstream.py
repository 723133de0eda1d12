# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Upstream vLLM P/D engines (NIXL pull and push): their `--kv-transfer-config` and environment.

* pull: `NixlConnector` (P `kv_producer`, D `kv_consumer`); D READs the KV
  with the `kv_transfer_params` P returned.
* push: `NixlPushConnector`; D's `kv_transfer_params` carry P's coordinates
  (engine id, side-channel host/port, TP/PP size) so D registers its blocks
  while P computes, and P WRITEs into them.

Every engine gets `VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1` and a port of its own.
"""

from __future__ import annotations

CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
SIDE_CHANNEL_HOST = "127.0.0.1"
PREFILL_ENGINE_ID = "upstream-prefill"
DECODE_ENGINE_ID = "upstream-decode"


def upstream_transfer_config(mode: str, role: str, engine_id: str) -> dict:
    """`--kv-transfer-config` for an upstream engine; `mode` is "pull" or "push", `role` "prefill" or "decode"."""
    return {
        "kv_connector": CONNECTORS[mode],
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }


def side_channel_env(side_channel_port: int) -> dict[str, str]:
    """Environment of one upstream engine: its NIXL side channel, and no kvpush plugin."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": SIDE_CHANNEL_HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        # Load no vLLM general plugins (in particular not kvpush's own connector plugin).
        "VLLM_PLUGINS": "",
    }
