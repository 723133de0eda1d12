# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush transfers without a router: both legs of one transfer sent at once, and the broker's record of it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.dev.localstack.completions import Completion, completions
from kvpush.dev.localstack.control_plane import ControlPlaneHandle


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
    """Plays a minimal push router: sends the P leg (max_tokens=1) and the D leg at once and waits for both."""
    transfer_id = transfer_id or new_transfer_id()
    p_params = transfer_params("prefill", transfer_id, decode_id, timeout_ms=timeout_ms)
    d_params = transfer_params("decode", transfer_id, prefill_id, timeout_ms=timeout_ms)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(completions, prefill_url, prompt, 1, kv_transfer_params=p_params, timeout=http_timeout)
        d = pool.submit(completions, decode_url, prompt, max_tokens, kv_transfer_params=d_params, timeout=http_timeout)
        results: list[Completion | Exception] = []
        for future in (p, d):
            try:
                results.append(future.result())
            except Exception as exc:  # the caller asserts on what failed
                results.append(exc)
    return Dispatch(transfer_id, results[0], results[1], time.monotonic() - t0)


# The broker's state of a transfer whose first side (by role) arrived and waits for the other.
_WAITING_FOR_THE_OTHER = {"decode": "TRANSFER_STATE_WAITING_FOR_PREFILL", "prefill": "TRANSFER_STATE_WAITING_FOR_REGISTRATION"}


def dispatch_in_order(control_plane: ControlPlaneHandle, prefill_url: str, prefill_id: str, decode_url: str, decode_id: str,
                      prompt: str | Sequence[int], max_tokens: int, first: str, *, wait_s: float = 30.0, http_timeout: float = 120.0) -> Dispatch:
    """Both legs of one transfer with the rendezvous order forced: `first` ("decode" or "prefill") reaches the broker alone.

    The second leg is sent once the broker holds the first side waiting
    (TimeoutError after `wait_s`).
    """
    from kvpush.rendezvous.v1 import transfer_pb2

    if first not in _WAITING_FOR_THE_OTHER:
        raise ValueError(f"first must be 'decode' or 'prefill', not {first!r}")
    transfer_id = new_transfer_id()
    legs = {
        "prefill": (prefill_url, 1, transfer_params("prefill", transfer_id, decode_id)),
        "decode": (decode_url, max_tokens, transfer_params("decode", transfer_id, prefill_id)),
    }
    waiting = transfer_pb2.TransferState.Value(_WAITING_FOR_THE_OTHER[first])

    def first_waits() -> bool:
        try:
            return get_transfer(control_plane, transfer_id).state == waiting
        except Exception:  # NOT_FOUND until the first side arrives
            return False

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {}
        url, tokens, params = legs[first]
        futures[first] = pool.submit(completions, url, prompt, tokens, kv_transfer_params=params, timeout=http_timeout)
        deadline = time.monotonic() + wait_s
        while not first_waits():
            if time.monotonic() > deadline or futures[first].done():
                raise TimeoutError(f"the {first} side of {transfer_id} did not wait at the broker within {wait_s:g} s")
            time.sleep(0.05)
        second = "prefill" if first == "decode" else "decode"
        url, tokens, params = legs[second]
        futures[second] = pool.submit(completions, url, prompt, tokens, kv_transfer_params=params, timeout=http_timeout)
        results: list[Completion | Exception] = []
        for name in ("prefill", "decode"):
            try:
                results.append(futures[name].result())
            except Exception as exc:  # the caller asserts on what failed
                results.append(exc)
    return Dispatch(transfer_id, results[0], results[1], time.monotonic() - t0)


def get_transfer(control_plane: ControlPlaneHandle, transfer_id: str, attempt: int = 0):
    """The broker's record of a transfer (the latest attempt by default)."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    async def fetch():
        async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
            return (await broker.get_transfer(pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))).transfer

    return asyncio.run(fetch())


def cancel_transfer(control_plane: ControlPlaneHandle, transfer_id: str, attempt: int = 1):
    """Cancels a transfer attempt as a router does when its client goes away."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    async def cancel():
        async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
            request = pb.CancelTransferRequest(detail="the client went away")
            request.key.transfer_id, request.key.attempt = transfer_id, attempt
            return await broker.cancel_transfer(request)

    return asyncio.run(cancel())
