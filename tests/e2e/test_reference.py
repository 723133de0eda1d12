# SPDX-License-Identifier: Apache-2.0
"""A single ordinary engine is deterministic and its outputs depend on the whole prompt.

These are the properties every P/D comparison relies on: the reference run
repeats exactly, and a wrong or missing first half of the KV would show.
"""

from __future__ import annotations

import pytest

from kvpush.dev.localstack.completions import completions, max_logprob_diff, max_logprob_shift, stream_completions
from kvpush.dev.localstack.engines import start_vllm_server
from kvpush.dev.localstack.metrics import free_kv_blocks, num_kv_blocks
from kvpush.dev.localstack.prompts import control_prompt, prompt_token_ids
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir

pytestmark = pytest.mark.engine

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ordinary engine with the standard flags."""
    model_dir = build_tiny_model(default_model_dir())
    handle = start_vllm_server(model_dir, log_path=tmp_path_factory.mktemp("logs") / "reference.log")
    yield handle
    handle.stop()
    assert handle.pids() == []


@pytest.mark.parametrize("num_tokens", [256, 1024])
def test_same_prompt_twice_gives_identical_outputs(server, num_tokens):
    prompt = prompt_token_ids(num_tokens, seed=num_tokens)
    first = completions(server.url, prompt, MAX_TOKENS)
    second = completions(server.url, prompt, MAX_TOKENS)
    assert len(first.token_ids) == MAX_TOKENS
    assert max_logprob_diff(first, second) <= 1e-6


@pytest.mark.parametrize("num_tokens", [256, 1024])
def test_changing_first_half_moves_logprobs(server, num_tokens):
    prompt = prompt_token_ids(num_tokens, seed=num_tokens)
    base = completions(server.url, prompt, MAX_TOKENS)
    control = completions(server.url, control_prompt(prompt), MAX_TOKENS)
    assert max_logprob_shift(base, control) >= 0.05


def test_streamed_output_equals_non_streamed(server):
    prompt = prompt_token_ids(256, seed=7)
    plain = completions(server.url, prompt, MAX_TOKENS)
    streamed = stream_completions(server.url, prompt, MAX_TOKENS)
    assert max_logprob_diff(plain, streamed) <= 1e-6
    assert streamed.ttft_s is not None and streamed.ttft_s <= streamed.total_s


def test_idle_engine_reports_all_blocks_free(server):
    completions(server.url, prompt_token_ids(256, seed=8), MAX_TOKENS)
    assert free_kv_blocks(server.url) == num_kv_blocks(server.url) - 1
