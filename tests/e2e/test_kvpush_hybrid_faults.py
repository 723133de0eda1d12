# SPDX-License-Identifier: Apache-2.0
"""Faults in the middle of hybrid-model transfers, between real vLLM CPU engines (P TP 1 → D TP 1).

The dense-model fault tests (test_kvpush_engines.py) do not cover what a
hybrid request holds beyond plain KV blocks: the Gemma-3-style model's
sliding-window group (blocks below the window go back early), and the
NemotronH model's Mamba2 state slot, one block per request from the same
pool (P stops one token short of the prompt for it). For each model one
pair checks, in order:

- the client leaving while D waits for KV that was never sent: the transfer
  ends CANCELLED (CANCELLED_BY_DECODE), is fenced, nothing is written, and
  every block and state slot comes back on both sides;
- the client leaving while P holds the request but has not computed it (P's
  engine core paused): once P computes the prefill of the cancelled transfer
  it must not write, and it must release its own blocks and state slot;
- P killed mid-transfer while D waits with a 60 s deadline: the request fails
  with PREFILL_ENGINE_LOST within seconds, nothing is written, and D has its
  blocks back and keeps serving. Last, as it kills P.

After each cancel an ordinary transfer must end DONE with the same output
as the pair's first transfer, so no stale KV or state was left where a later
request reads it. Block counts are vLLM's own (`free_kv_blocks`), which count
the Mamba state blocks too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from dataclasses import dataclass

import pytest

from kvpush.dev.localstack.completions import Completion, HttpError, completion_body, completions
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import dispatch, get_transfer, new_transfer_id, transfer_params
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.rendezvous.v1 import transfer_pb2
from tests.e2e.engine_faults import assert_free_blocks_return, background, engine_core, paused, settled_free_blocks, transfer_or_none
from tests.e2e.pd_pair import MAX_TOKENS, checked_transfers, pd_pair
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

SERVED_PROMPT = prompt_token_ids(300, seed=300)  # several blocks, not a multiple of the 128-token block
CANCELLED_PROMPT = prompt_token_ids(1000, seed=1000)  # many blocks held on D: a leak of them shows in the count
WRITE_RESULT = transfer_pb2.TIMELINE_ENTRY_KIND_WRITE_RESULT
WAITING_FOR_PREFILL = transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL


@dataclass
class Pair:
    ids: tuple[str, str]
    control_plane: object
    prefill: object
    decode: object
    baseline: Completion  # D's output for SERVED_PROMPT in the pair's first transfer
    free_blocks: tuple[int, int]  # (P, D) once that transfer was over


@pytest.fixture(scope="module", params=["gemma3", "nemotron_h"])
def pair(request, tmp_path_factory):
    """One P/D pair per model; pytest runs all of a model's tests on its pair before starting the next."""
    arch = request.param
    model = build_tiny_model(default_model_dir(arch), arch=arch)
    ids = (f"prefill-{arch}", f"decode-{arch}")
    with pd_pair(tmp_path_factory.mktemp(arch), model, ids) as (control_plane, prefill, decode):
        # The first transfer also pays each engine's one-time costs; its output is what later transfers must repeat.
        first = dispatch(prefill.url, ids[0], decode.url, ids[1], SERVED_PROMPT, MAX_TOKENS)
        assert not isinstance(first.decode, Exception), first.decode
        assert get_transfer(control_plane, first.transfer_id).state == transfer_pb2.TRANSFER_STATE_DONE
        yield Pair(ids, control_plane, prefill, decode, first.decode, (settled_free_blocks(prefill), settled_free_blocks(decode)))


def wait_until_decode_waits(pair: Pair, transfer_id: str) -> None:
    wait_for(lambda: getattr(transfer_or_none(pair, transfer_id), "state", None) == WAITING_FOR_PREFILL, 30,
             what="D registered and waiting for P")


def write_results(transfer, outcome: str) -> list[str]:
    """The producer ranks' answers with this outcome (e.g. "WRITE_OUTCOME_WRITTEN") in the broker's timeline."""
    return [e.detail for e in transfer.timeline if e.kind == WRITE_RESULT and outcome in e.detail]


def written(transfer) -> list[str]:
    return write_results(transfer, "WRITE_OUTCOME_WRITTEN")


@contextlib.contextmanager
def streaming_decode_leg(pair: Pair, transfer_id: str, prompt):
    """D's leg as a streamed request whose connection the caller closes to play a client going away."""
    body = completion_body(prompt, MAX_TOKENS, stream=True, kv_transfer_params=transfer_params("decode", transfer_id, pair.ids[0]))
    host, port = pair.decode.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        yield conn
    finally:
        conn.close()


def disconnect(conn: http.client.HTTPConnection) -> None:
    conn.sock.close()  # the client goes away mid-wait; D aborts the request and cancels its transfer
    conn.close()


def assert_cancelled_by_decode_and_fenced(pair: Pair, transfer_id: str):
    wait_for(lambda: getattr(transfer_or_none(pair, transfer_id), "state", None) == transfer_pb2.TRANSFER_STATE_CANCELLED, 30,
             what="transfer cancelled")
    # D's registration sent P an early order; the broker revoked it at the cancel. P's rank answers REVOKED (a promise never
    # to write for the attempt), which fences the attempt a moment after the cancel, not a WRITE timeout later.
    transfer = wait_for(lambda: (t := get_transfer(pair.control_plane, transfer_id)).fenced and t, 30, what="attempt fenced")
    assert transfer.end_reason == transfer_pb2.END_REASON_CANCELLED_BY_DECODE, transfer
    assert write_results(transfer, "WRITE_OUTCOME_REVOKED"), transfer
    return transfer


def assert_serves_as_before(pair: Pair) -> None:
    """An ordinary transfer ends DONE with the pair's first output: nothing stale was left where it reads."""
    for _, transfer in checked_transfers(pair.control_plane, pair.prefill, pair.decode, pair.ids, [SERVED_PROMPT], [pair.baseline],
                                         both_orders_at=-1):
        assert transfer.bytes_written > 0


def test_a_cancel_while_decode_waits_is_fenced_writes_nothing_and_frees_every_block(pair):
    transfer_id = new_transfer_id()
    with streaming_decode_leg(pair, transfer_id, CANCELLED_PROMPT) as conn:
        wait_until_decode_waits(pair, transfer_id)
        disconnect(conn)
        transfer = assert_cancelled_by_decode_and_fenced(pair, transfer_id)
    assert not written(transfer) and transfer.bytes_written == 0, transfer
    assert_free_blocks_return([pair.prefill, pair.decode], pair.free_blocks)
    # Asked again after the blocks were back: no WRITE came late.
    assert not written(get_transfer(pair.control_plane, transfer_id))
    assert_serves_as_before(pair)
    assert_free_blocks_return([pair.prefill, pair.decode], pair.free_blocks)


def test_a_cancel_before_prefill_computes_writes_nothing_when_it_does_and_frees_both_sides(pair):
    """P has the request while its engine core is paused; D's client leaves; then P computes the cancelled prefill."""
    transfer_id = new_transfer_id()
    p_params = transfer_params("prefill", transfer_id, pair.ids[1])
    with paused(engine_core(pair.prefill)):
        # The pause holds only P's scheduler: its worker, which keeps the lease and answers revocations, runs on.
        p_leg, p_outcome = background(lambda: completions(pair.prefill.url, CANCELLED_PROMPT, 1, kv_transfer_params=p_params, timeout=120))
        with streaming_decode_leg(pair, transfer_id, CANCELLED_PROMPT) as conn:
            wait_until_decode_waits(pair, transfer_id)
            # P's API server has had this time to pass its request to the paused engine core (a later arrival must end the same).
            time.sleep(1.0)
            disconnect(conn)
            assert_cancelled_by_decode_and_fenced(pair, transfer_id)
    # P now computes the prefill of a transfer that is over: its leg ends, and no WRITE for it may land in D's freed blocks.
    p_leg.join(timeout=60)
    assert "result" in p_outcome, "P's leg did not end within 60 s of its engine core resuming"
    assert_free_blocks_return([pair.prefill, pair.decode], pair.free_blocks)
    transfer = get_transfer(pair.control_plane, transfer_id)
    assert not written(transfer) and transfer.bytes_written == 0, transfer
    assert transfer.end_reason == transfer_pb2.END_REASON_CANCELLED_BY_DECODE, transfer
    assert_serves_as_before(pair)
    assert_free_blocks_return([pair.prefill, pair.decode], pair.free_blocks)


def test_prefill_killed_mid_transfer_fails_it_with_engine_lost_in_seconds_and_decode_keeps_serving(pair):
    """Last for its pair: it kills P. D's 60 s deadline must not be what ends the request."""
    transfer_id = new_transfer_id()
    d_params = transfer_params("decode", transfer_id, pair.ids[0], timeout_ms=60_000)
    p_params = transfer_params("prefill", transfer_id, pair.ids[1], timeout_ms=60_000)
    # P holds the request uncomputed (engine core paused) and has D's early order when the whole group dies.
    with paused(engine_core(pair.prefill)):
        d_leg, d_outcome = background(lambda: completions(pair.decode.url, CANCELLED_PROMPT, MAX_TOKENS, kv_transfer_params=d_params,
                                                          timeout=120))
        background(lambda: completions(pair.prefill.url, CANCELLED_PROMPT, 1, kv_transfer_params=p_params, timeout=120))
        wait_until_decode_waits(pair, transfer_id)
        time.sleep(1.0)  # as above: P's API server passes the request on
        killed_at = time.monotonic()
        pair.prefill.kill()  # SIGKILL of the whole process group, as a crash would
    d_leg.join(timeout=60)
    assert isinstance(d_outcome.get("result"), HttpError), d_outcome
    assert time.monotonic() - killed_at < 30, "D must not wait for its 60 s deadline"
    transfer = get_transfer(pair.control_plane, transfer_id)
    assert transfer.state == transfer_pb2.TRANSFER_STATE_FAILED, transfer
    assert transfer.end_reason == transfer_pb2.END_REASON_PREFILL_ENGINE_LOST, transfer
    # D gives its blocks back only once no WRITE can land: the dead rank never answers, so the broker fences it by time.
    assert transfer.fenced, transfer
    assert not written(transfer) and transfer.bytes_written == 0, transfer
    # D has every block and state slot back and serves ordinary requests.
    assert_free_blocks_return([pair.decode], pair.free_blocks[1:])
    assert len(completions(pair.decode.url, SERVED_PROMPT, MAX_TOKENS).token_ids) == MAX_TOKENS
