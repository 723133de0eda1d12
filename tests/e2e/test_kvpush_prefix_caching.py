# SPDX-License-Identifier: Apache-2.0
"""Prefix caching on, on both real vLLM CPU engines: D's local hit stays out of the transfer.

D registers only the tokens its own prefix cache lacks (its cached blocks
may be shared with other requests, so no WRITE may reach them), and P
writes only those, whatever it had cached itself. vLLM computes a prompt's
last token on D in any case, so a D that holds every block but the last
token's needs no transfer at all: P frees its blocks at once. Bytes moved
are checked against the broker's record, outputs against a single engine
with prefix caching on (token ids equal, logprobs within 1e-3), in both
arrival orders, with equal and with different block sizes.
"""

from __future__ import annotations

import contextlib

import pytest

from kvpush.dev.localstack.completions import completions, max_logprob_diff
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import reference_run, start_vllm_servers
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import dispatch, dispatch_in_order, get_transfer
from kvpush.rendezvous.v1 import transfer_pb2
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers x planes x KV heads x head size x float32
PREFIX = 1000  # shared by the first two prompts
SUFFIX = 300
FULL_HIT = 1025  # 8 whole 128-token blocks and one token: D's cache can hold all but the last


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    prefix = prompt_token_ids(PREFIX, seed=5)
    prompts = {"first": prefix + prompt_token_ids(SUFFIX, seed=11), "second": prefix + prompt_token_ids(SUFFIX, seed=12),
               "full": prompt_token_ids(FULL_HIT, seed=77)}
    outputs = reference_run(model_dir, list(prompts.values()), MAX_TOKENS, prefix_caching=True,
                            log_path=tmp_path_factory.mktemp("ref") / "reference.log")
    return prompts, dict(zip(prompts, outputs))


@contextlib.contextmanager
def engines(tmp_path, model_dir, prefill_block: int, decode_block: int):
    """(control plane, P, D) with prefix caching on and these block sizes; all stopped afterwards."""
    control_plane = start_control_plane(tmp_path / "control-plane", engine_ids=("prefill-0", "decode-0"))
    spawns = [dict(name=role, kv_transfer_config=kvpush_transfer_config(role, f"{role}-0", control_plane), prefix_caching=True,
                   extra_args=["--block-size", str(block)], cpu_list=cpu, log_path=tmp_path / f"{role}.log")
              for role, block, cpu in (("prefill", prefill_block, "0"), ("decode", decode_block, "1"))]
    servers = []
    try:
        servers = start_vllm_servers(spawns, model_dir)
        yield (control_plane, *servers)
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


def ordered(control_plane, prefill, decode, prompt, first: str):
    """One transfer with the rendezvous order forced: `first` reaches the broker alone."""
    return dispatch_in_order(control_plane, prefill.url, "prefill-0", decode.url, "decode-0", prompt, MAX_TOKENS, first)


def moved(control_plane, result, want) -> int:
    """The bytes the transfer wrote, after checking D's output against the single engine's."""
    assert not isinstance(result.decode, Exception), result.decode
    assert not isinstance(result.prefill, Exception), result.prefill
    assert result.decode.token_ids == want.token_ids
    assert max_logprob_diff(want, result.decode) < 1e-3
    return get_transfer(control_plane, result.transfer_id).bytes_written


def blocks_of(tokens: int, block: int) -> int:
    return -(-tokens // block)


def test_only_the_blocks_d_lacks_move_and_a_full_hit_moves_nothing(tmp_path, model_dir, reference):
    prompts, want = reference
    with engines(tmp_path, model_dir, 128, 128) as (control_plane, prefill, decode):
        first_len = PREFIX + SUFFIX
        # Cold: every token but the last, in whole 128-token pages.
        cold = moved(control_plane, ordered(control_plane, prefill, decode, prompts["first"], "decode"), want["first"])
        assert cold == blocks_of(first_len - 1, 128) * 128 * KV_BYTES_PER_TOKEN
        # D holds the shared prefix's 7 whole blocks (896 tokens): only blocks 7-10 move.
        hit = moved(control_plane, ordered(control_plane, prefill, decode, prompts["second"], "prefill"), want["second"])
        assert hit == (blocks_of(first_len - 1, 128) - PREFIX // 128) * 128 * KV_BYTES_PER_TOKEN
        # The same prompt again: D holds 10 blocks (1,280 tokens), one block moves; P wrote it from its own cache.
        again = moved(control_plane, ordered(control_plane, prefill, decode, prompts["second"], "decode"), want["second"])
        assert again == 128 * KV_BYTES_PER_TOKEN
        free_before = free_kv_blocks(prefill.url)
        cold_full = moved(control_plane, dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompts["full"], MAX_TOKENS), want["full"])
        assert cold_full == (FULL_HIT - 1) * KV_BYTES_PER_TOKEN  # 8 whole blocks
        # Full hit: D had every block but the last token's, so nothing is written and P's blocks go back at once.
        full = dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompts["full"], MAX_TOKENS)
        assert moved(control_plane, full, want["full"]) == 0
        transfer = get_transfer(control_plane, full.transfer_id)
        assert transfer.state == transfer_pb2.TRANSFER_STATE_CANCELLED
        assert transfer.end_reason == transfer_pb2.END_REASON_CANCELLED_BY_DECODE

        def p_freed():
            completions(prefill.url, prompt_token_ids(4, seed=7), 1)  # vLLM publishes the gauge from engine steps
            return free_kv_blocks(prefill.url) >= free_before or None

        wait_for(p_freed, 20, interval=0.5, what=f"P's free blocks back to {free_before}")


def test_a_prefix_hit_off_p_s_block_boundary_moves_exactly_the_missing_tokens(tmp_path, model_dir, reference):
    prompts, want = reference
    with engines(tmp_path, model_dir, 128, 64) as (control_plane, prefill, decode):
        first_len = PREFIX + SUFFIX
        cold = moved(control_plane, ordered(control_plane, prefill, decode, prompts["first"], "prefill"), want["first"])
        assert cold == (first_len - 1) * KV_BYTES_PER_TOKEN  # block sizes differ: token runs, not pages
        # D's hit is 15 blocks of 64 (960 tokens), in the middle of P's 8th 128-token block.
        hit = moved(control_plane, ordered(control_plane, prefill, decode, prompts["second"], "decode"), want["second"])
        assert hit == (first_len - 1 - PREFIX // 64 * 64) * KV_BYTES_PER_TOKEN
