# SPDX-License-Identifier: Apache-2.0
"""A kvpush P/D pair on real engines, and transfers through it checked against a reference, for the engine tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvpush.dev.localstack.completions import max_logprob_diff
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import start_vllm_servers
from kvpush.dev.localstack.transfers import dispatch, dispatch_in_order, get_transfer
from kvpush.rendezvous.v1 import transfer_pb2

MAX_TOKENS = 6


@contextlib.contextmanager
def pd_pair(tmp_path: Path, model_dir: Path, engine_ids: tuple[str, str], prefill_args: Sequence[str] = (),
            decode_args: Sequence[str] = (), **connector_settings: object) -> Iterator[tuple]:
    """(control plane, P, D): P on core 0, D on core 1, each with its own extra engine arguments and both with the connector
    settings given (kv_connector_extra_config); all stopped afterwards."""
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=engine_ids)
    servers = []
    try:
        servers = start_vllm_servers([dict(name=role, kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane, **connector_settings),
                                           extra_args=list(args), cpu_list=cpu, log_path=tmp_path / f"{role}.log")
                                      for role, engine_id, args, cpu in (("prefill", engine_ids[0], prefill_args, "0"),
                                                                         ("decode", engine_ids[1], decode_args, "1"))], model_dir)
        yield (control_plane, *servers)
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


def checked_transfers(control_plane, prefill, decode, engine_ids: tuple[str, str], prompts, expected, both_orders_at: int) -> Iterator:
    """Sends each prompt (the one at both_orders_at twice, each arrival order forced) and yields (prompt, its broker record).

    Every transfer must have ended DONE with D's output equal to the
    reference's: token ids, and per-token logprobs within 1e-3.
    """
    p_id, d_id = engine_ids
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        if i == both_orders_at:
            results = [dispatch_in_order(control_plane, prefill.url, p_id, decode.url, d_id, prompt, MAX_TOKENS, first)
                       for first in ("decode", "prefill")]
        else:
            results = [dispatch(prefill.url, p_id, decode.url, d_id, prompt, MAX_TOKENS)]
        for result in results:
            assert not isinstance(result.decode, Exception), result.decode
            assert result.decode.token_ids == want.token_ids, len(prompt)
            assert max_logprob_diff(want, result.decode) < 1e-3
            transfer = get_transfer(control_plane, result.transfer_id)
            assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE
            yield prompt, transfer
