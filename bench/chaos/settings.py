# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""One chaos run's settings (the short CI form and the long documented one), the faults and the stack's fixed figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

PREFILL_ID, DECODE_ID = "prefill-0", "decode-0"
SOAK_PREFILL_ID, SOAK_DECODE_ID = "chaos-soak-prefill", "chaos-soak-decode"
ROLES = {"prefill": (PREFILL_ID, "0"), "decode": (DECODE_ID, "1")}  # role -> engine id, CPU
# Prompts of token ids (no tokenizer round trip): below one 128-token block, around block edges, long.
PROMPT_LENGTHS = (5, 40, 127, 129, 300, 1000, 2000)
MAX_TOKENS_CHOICES = (1, 2, 4, 8, 16)
MAX_TOKENS = max(MAX_TOKENS_CHOICES)
STREAM_SHARE = 0.5
# The connector's shortest hold margin: D keeps a failed request's blocks this long past its deadline without the broker's word.
HOLD_MARGIN_S = 1.5
# A request is hung when it has no answer this long past its deadline; a failure must be answered by deadline + FAILURE_SLACK_S.
HANG_SLACK_S = 5.0
FAILURE_SLACK_S = 1.0
BROKER_RETENTION_S = 60.0  # the control plane's --retention default: settled attempts are remembered this long

FAULTS: dict[str, str] = {
    "p-kill": "kill -9 of P, then P restarted (same engine id, new incarnation)",
    "d-kill": "kill -9 of D, then D restarted",
    "cp-kill": "kill -9 of the control plane, restarted on the same port and tokens dir",
    "p-stop": "SIGSTOP of P longer than its lease TTL, then SIGCONT",
    "proxy-cut": "P's proxy to the control plane cuts every connection and refuses new ones, then heals",
    "disconnects": "clients close their HTTP connection at random times mid-request",
    "collide": "two decode legs sharing one (transfer_id, attempt) + its prefill leg, straight to D/P; malformed kvpush params",
    # The scaled-out control plane's faults (settings.scaled):
    "shard-pause": "SIGSTOP of the broker shard every client follows first, past its lease; probes owned by it until one succeeds; SIGCONT",
    "shard-kill": "kill -9 of one broker shard; probes owned by it until one succeeds; the shard restarted (it rejoins)",
    "leader-shard-kill": "kill -9 of etcd's leader and one broker shard at once; probes owned by the shard until one succeeds; both restarted",
    "etcd-kill": "kill -9 of one etcd member, restarted after a while",
    "registrar-kill": "kill -9 of one registrar replica, restarted after a while",
    "registrars-down": "kill -9 of every registrar replica for registrar_outage_s (inside the engines' outage grace), then all restarted",
    "shard-cut-engines": "the broker shard every client follows first cut off from engines and router (not etcd); probes owned by it; healed",
    "shard-cut-etcd": "the broker shard every client follows first cut off from etcd (not the engines); probes owned by it; healed",
}
# Faults that need the embedded control plane (its process, P's proxy) or the scaled one.
EMBEDDED_ONLY = ("cp-kill", "proxy-cut")
SCALED_ONLY = ("shard-pause", "shard-kill", "leader-shard-kill", "etcd-kill", "registrar-kill", "registrars-down", "shard-cut-engines", "shard-cut-etcd")
# Partition faults run through proxies in front of one broker member (the first of every client's broker target).
PARTITION_FAULTS = ("shard-cut-engines", "shard-cut-etcd")
PARTITIONED_MEMBER = "broker-0"
FAILOVER_ORDER = ("shard-pause", "shard-cut-engines", "shard-cut-etcd", "shard-kill", "etcd-kill", "registrar-kill", "registrars-down")
LONG_ORDER = ("p-kill", "d-kill", "cp-kill", "p-stop", "proxy-cut", "disconnects", "collide")
# The CI form: the cheap faults first, the one that restarts an engine last (its restart is the longest step).
SHORT_ORDER = ("disconnects", "collide", "proxy-cut", "p-stop", "cp-kill", "p-kill")


@dataclasses.dataclass
class Settings:
    """One chaos run: which faults, how much load, how long each fault lasts."""

    faults: tuple[str, ...] = SHORT_ORDER
    clients: int = 3
    timeout_ms: int = 4000  # the router's --transfer-timeout-ms: every request's deadline
    pre_s: float = 3.0  # load before each fault
    post_s: float = 3.0  # load after the router serves again
    stop_s: float = 5.0  # p-stop: how long P stays stopped (its lease TTL is 3 s)
    cut_s: float = 8.0  # proxy-cut: how long the path stays cut
    cp_down_s: float = 1.0  # cp-kill: how long the control plane stays dead before its restart
    disconnect_s: float = 5.0  # disconnects: how long clients hang up at random
    disconnect_share: float = 0.6  # disconnects: share of requests the client hangs up on
    collide_rounds: int = 1
    think_s: float = 0.05  # each client's pause between requests
    soak_attempts: int = 0  # 0: no soak
    soak_timeout_s: float = 15.0
    soak_settle_s: float = BROKER_RETENTION_S + 10.0
    seed: int = 20261201
    scaled: bool = False  # the scaled-out control plane (etcd, registrar replicas, broker shards) instead of the embedded one
    shards: int = 3
    shard_lease_ttl_s: float = 2.0
    part_down_s: float = 3.0  # etcd-kill / registrar-kill / shard-kill: how long the part stays dead before its restart
    pause_s: float = 6.0  # shard-pause / shard-cut-*: how long the member stays stopped or cut off (longer than its lease)
    registrar_outage_s: float = 5.0  # registrars-down: how long no registrar replica runs
    run_dir: Path | None = None
    model_dir: Path | None = None

    @property
    def deadline_s(self) -> float:
        return self.timeout_ms / 1000.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir) if self.run_dir else None
        out["model_dir"] = str(self.model_dir) if self.model_dir else None
        out["faults"] = list(self.faults)
        return out


def short_settings(**overrides: Any) -> Settings:
    """The CI form: one stack, the faults that fit in about three minutes with engine start."""
    return dataclasses.replace(Settings(), **overrides)


def long_settings(**overrides: Any) -> Settings:
    """The documented form: every fault, a minute of load before and after each, the soak."""
    base = Settings(
        faults=LONG_ORDER, clients=4, timeout_ms=5000, pre_s=60.0, post_s=60.0, stop_s=8.0, cut_s=10.0, cp_down_s=2.0,
        disconnect_s=60.0, collide_rounds=3, soak_attempts=1000,
    )
    return dataclasses.replace(base, **overrides)
