# SPDX-License-Identifier: Apache-2.0
"""bench/gpu_datapath.py on CPU DRAM: two real NIXL agents move verified bytes, and the numbers add up."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_datapath.py"
LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE = 3, 1, 8, 4
PAGE_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # one block of one layer, keys and values, bf16
TOKENS = (8, 30)  # 30: the last block is partly filled
ROW_PAIR_BYTES = HEADS * 2 * HEAD_SIZE * 2  # one token's keys and values
ITERS = 2


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_datapath", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    pytest.importorskip("nixl")
    out = tmp_path_factory.mktemp("gpu_datapath") / "result.json"
    command = [sys.executable, str(BENCH), "--device", "cpu", "--tokens", ",".join(map(str, TOKENS)), "--layers", str(LAYERS),
               "--kv-heads", str(HEADS), "--head-size", str(HEAD_SIZE), "--block-size", str(BLOCK_SIZE),
               "--iters", str(ITERS), "--warmup", "1", "--copy-reps", "3", "--timeout", "30", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_every_transfer_moves_the_right_bytes(cpu_run):
    result, _ = cpu_run
    assert result["complete"] and result["error"] is None
    cells = {(c["tokens"], c["ids"], c["path"]): c for c in result["transfers"]}
    assert set(cells) == {(t, i, p) for t in TOKENS for i in ("consecutive", "random") for p in ("merged", "unmerged")}
    for (tokens, ids, path), cell in cells.items():
        blocks = -(-tokens // BLOCK_SIZE)
        assert cell["verified"] and not cell["failures"], cell
        assert cell["bytes"] == LAYERS * blocks * BLOCK_SIZE * ROW_PAIR_BYTES  # whole blocks, the last partly filled one too
        assert len(cell["samples"]) == ITERS and len(cell["warmup"]) == 1
        if path == "unmerged":
            assert cell["descriptors"] * PAGE_BYTES == 2 * cell["bytes"]  # one per (layer, plane, block) of full blocks
        elif ids == "consecutive":
            assert cell["descriptors"] == LAYERS  # one per layer
        else:
            assert LAYERS <= cell["descriptors"] <= LAYERS * blocks


def test_timings_are_measured_and_consistent(cpu_run):
    result, stdout = cpu_run
    for cell in result["transfers"]:
        for sample in cell["samples"] + cell["warmup"]:
            assert all(math.isfinite(v) and v >= 0 for v in sample.values()), sample
            assert sample["done_ms"] >= sample["post_ms"] > 0  # DONE is timed from the same start as the post
        assert cell["median_notif_ms"] > 0 and cell["gbps_notif"] == pytest.approx(cell["bytes"] / (cell["median_notif_ms"] * 1e6))
    copies = {c["bytes"] for c in result["copies"] if c["kind"] == "torch copy_" and c["verified"] and c["gbps"] > 0}
    assert copies == {c["bytes"] for c in result["transfers"]}
    assert all(math.isfinite(s["fraction_of_copy"]) and s["fraction_of_copy"] > 0 for s in result["summary"])
    assert result["connect_ms"] > 0
    assert "->notif ms" in stdout and stdout.count(" yes") == len(result["transfers"]) + len(result["copies"])


def test_verification_catches_wrong_and_stray_bytes():
    bench = load_bench()
    geometry = bench.Geometry(layers=2, heads=1, head_size=4, block_size=2, num_blocks=6)
    cache = bench.allocate_cache(geometry, torch.device("cpu")).view(torch.int16)
    dst = torch.tensor([4, 1])
    expected = bench.seeded_bits(11, geometry, 2, torch.device("cpu"))
    cache.fill_(bench.POISON)
    cache.index_copy_(1, dst, expected)
    assert bench.verify_blocks(cache, dst, expected, tokens=4).ok
    assert bench.verify_blocks(cache, dst, expected, tokens=3).stray_blocks == 1  # block 1 holds a 4th token
    cache[1, 4, 0, 1, 3] += 1  # one element of layer 1 is wrong
    cache[0, 2, 0, 0, 0] = 0  # a block outside the destination was written
    verdict = bench.verify_blocks(cache, dst, expected, tokens=4)
    assert verdict.mismatched_elements_by_layer == {1: 1} and verdict.stray_blocks == 1 and not verdict.ok
    assert not bench.verify_blocks(cache, dst, bench.seeded_bits(12, geometry, 2, torch.device("cpu")), tokens=4).ok
