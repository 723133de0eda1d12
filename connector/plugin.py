# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin entry point: makes `"kv_connector": "KvpushConnector"` work once kvpush is installed."""

from __future__ import annotations

CONNECTOR_NAME = "KvpushConnector"


def register() -> None:
    """Registers the connector with vLLM's factory (called by vLLM's general plugin loader in every process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvpush.connector.connector", CONNECTOR_NAME)
