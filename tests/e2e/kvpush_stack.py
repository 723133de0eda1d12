# SPDX-License-Identifier: Apache-2.0
"""A local kvpush control plane plus P/D engines, for tests, the demo and benchmarks.

`start_control_plane` runs `kvpush control-plane` on 127.0.0.1 (port 0 by
default, read back from its port file) with a tokens directory (one token
per identity: the router and each engine) kept in a work directory, so it
can be stopped and restarted on the same port with the same credentials. `dispatch` plays a minimal router: both
legs of one transfer at once, as the push protocol wants.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpush.services.common.tokens import ROUTER_IDENTITY, create_tokens
from tests.e2e.harness import Completion, completions, stop_process, wait_for_port_file

CONTROL_PLANE_START_TIMEOUT_S = 30.0
# The engines a control plane started here has tokens for, unless told others.
DEFAULT_ENGINE_IDS = ("prefill-0", "decode-0")


@dataclass
class ControlPlaneHandle:
    """A running `kvpush control-plane` process."""

    process: subprocess.Popen
    port: int
    work_dir: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def tokens_dir(self) -> Path:
        return _tokens_dir(self.work_dir)

    def token_file_of(self, identity: str) -> Path:
        """The token file of identity (the router or an engine the control plane was started for)."""
        path = self.tokens_dir / identity
        if not path.exists():
            raise ValueError(f"no token for {identity!r}: pass it in start_control_plane(engine_ids=...)")
        return path

    @property
    def token_file(self) -> Path:
        """The router's token file (what a router, or a test querying transfers, presents)."""
        return self.token_file_of(ROUTER_IDENTITY)

    @property
    def token(self) -> str:
        """The router's token."""
        return self.token_file.read_text().strip()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL if it is still there after `timeout`."""
        stop_process(self.process, timeout)

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


def _tokens_dir(work_dir: Path) -> Path:
    return work_dir / "tokens"


def start_control_plane(work_dir: Path, *, port: int = 0, env: Mapping[str, str] | None = None,
                        extra_args: Sequence[str] = (), engine_ids: Sequence[str] = DEFAULT_ENGINE_IDS) -> ControlPlaneHandle:
    """Starts the embedded control plane and waits until it serves (bounded).

    The router and engine_ids get tokens (kept across restarts in the same work_dir).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    create_tokens(_tokens_dir(work_dir), [ROUTER_IDENTITY, *engine_ids])
    port_file = work_dir / "port"
    port_file.unlink(missing_ok=True)
    log = (work_dir / "control-plane.log").open("ab")
    cmd = [
        sys.executable, "-m", "kvpush.cli", "control-plane",
        "--listen", f"127.0.0.1:{port}",
        "--port-file", str(port_file),
        "--tokens-dir", str(_tokens_dir(work_dir)),
        *extra_args,
    ]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    port = wait_for_port_file(process, port_file, CONTROL_PLANE_START_TIMEOUT_S, "control plane", work_dir / "control-plane.log")
    return ControlPlaneHandle(process, port, work_dir)


def kvpush_transfer_config(role: str, engine_id: str, control_plane: ControlPlaneHandle, **extra: object) -> dict:
    """vLLM --kv-transfer-config for a kvpush engine; `extra` goes to kv_connector_extra_config."""
    return {
        "kv_connector": "KvpushConnector",
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
        "engine_id": engine_id,
        "kv_connector_extra_config": {"control_plane": control_plane.address, "token_file": str(control_plane.token_file_of(engine_id)), **extra},
    }


def transfer_params(role: str, transfer_id: str, peer_engine_id: str, *, attempt: int = 1, timeout_ms: int | None = None) -> dict:
    """kv_transfer_params for one leg."""
    peer_key = "prefill_engine_id" if role == "decode" else "decode_engine_id"
    params: dict = {"role": role, "transfer_id": transfer_id, "attempt": attempt, peer_key: peer_engine_id}
    if timeout_ms is not None:
        params["timeout_ms"] = timeout_ms
    return {"kvpush": params}


def new_transfer_id() -> str:
    return "xfer-" + uuid.uuid4().hex


@dataclass
class Dispatch:
    """The outcome of both legs of one transfer."""

    transfer_id: str
    prefill: Completion | Exception
    decode: Completion | Exception
    seconds: float


def dispatch(prefill_url: str, prefill_id: str, decode_url: str, decode_id: str, prompt: str | Sequence[int],
             max_tokens: int, *, transfer_id: str | None = None, timeout_ms: int | None = None,
             http_timeout: float = 120.0) -> Dispatch:
    """Sends the P leg (max_tokens=1) and the D leg at once and waits for both."""
    transfer_id = transfer_id or new_transfer_id()
    p_params = transfer_params("prefill", transfer_id, decode_id, timeout_ms=timeout_ms)
    d_params = transfer_params("decode", transfer_id, prefill_id, timeout_ms=timeout_ms)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(completions, prefill_url, prompt, 1, kv_transfer_params=p_params, timeout=http_timeout)
        d = pool.submit(completions, decode_url, prompt, max_tokens, kv_transfer_params=d_params, timeout=http_timeout)
        results = []
        for future in (p, d):
            try:
                results.append(future.result())
            except Exception as exc:  # the caller asserts on what failed
                results.append(exc)
    return Dispatch(transfer_id, results[0], results[1], time.monotonic() - t0)


def cancel_transfer(control_plane: ControlPlaneHandle, transfer_id: str, attempt: int = 1):
    """Cancels a transfer attempt as the router does when its client goes away."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    async def cancel():
        async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
            request = pb.CancelTransferRequest(detail="the client went away")
            request.key.transfer_id, request.key.attempt = transfer_id, attempt
            return await broker.cancel_transfer(request)

    return asyncio.run(cancel())


def get_transfer(control_plane: ControlPlaneHandle, transfer_id: str, attempt: int = 0):
    """The broker's record of a transfer (the latest attempt by default)."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    async def fetch():
        async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
            return (await broker.get_transfer(pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))).transfer

    return asyncio.run(fetch())


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Polls predicate() until it returns a truthy value; raises TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g} s (last: {value!r})")
        time.sleep(interval)
