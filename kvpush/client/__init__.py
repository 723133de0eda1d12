# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The typed Python client of the kvpush control plane: the one way code talks to it."""

from kvpush.client.broker import BrokerClient
from kvpush.client.config import ClientConfig, RetryPolicy
from kvpush.client.loop_thread import LoopThread
from kvpush.client.registrar import RegistrarClient
from kvpush.client.rpc import BidiStreamCall, StreamCall
from kvpush.client.shard_map import UNSHARDED, ShardMap
from kvpush.client.sharded_broker import ShardedBrokerClient

__all__ = [
    "BidiStreamCall",
    "BrokerClient",
    "ClientConfig",
    "LoopThread",
    "RegistrarClient",
    "RetryPolicy",
    "ShardMap",
    "ShardedBrokerClient",
    "StreamCall",
    "UNSHARDED",
]
