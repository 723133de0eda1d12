# SPDX-License-Identifier: Apache-2.0
"""bench/gpu_datapath.py on CPU DRAM: two real NIXL agents move verified bytes, and the numbers add up."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE = 3, 1, 8, 4
PAGE_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # one block of one layer, keys and values, bf16
TOKENS = (8, 30)  # 30: the last block is partly filled
ROW_PAIR_BYTES = HEADS * 2 * HEAD_SIZE * 2  # one token's keys and values
ITERS = 2
PATHS = ("merged", "prepped", "unmerged")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    pytest.importorskip("nixl")
    out = tmp_path_factory.mktemp("gpu_datapath") / "result.json"
    tokens = ",".join(map(str, TOKENS))
    command = [sys.executable, "-m", "bench.gpu_datapath", "--device", "cpu", "--tokens", tokens, "--random-tokens", tokens,
               "--layers", str(LAYERS), "--kv-heads", str(HEADS), "--head-size", str(HEAD_SIZE), "--block-size", str(BLOCK_SIZE),
               "--paths", ",".join(PATHS), "--iters", str(ITERS), "--warmup", "1", "--timeout", "30", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_every_transfer_moves_the_right_bytes(cpu_run):
    result, _ = cpu_run
    assert result["complete"] and result["error"] is None
    cells = {(c["tokens"], c["ids"], c["path"], c["d_work"]): c for c in result["transfers"]}
    writes = {(t, i, p, d) for t in TOKENS for i in ("consecutive", "random") for p in PATHS for d in ("fill", "idle")}
    assert set(cells) == writes | {(t, "consecutive", "copy", d) for t in TOKENS for d in ("fill", "idle")}
    for (tokens, ids, path, _), cell in cells.items():
        blocks = -(-tokens // BLOCK_SIZE)
        assert cell["verified"] and not cell["failures"], cell
        assert cell["bytes"] == LAYERS * blocks * BLOCK_SIZE * ROW_PAIR_BYTES  # whole blocks, the last partly filled one too
        assert len(cell["samples"]) == ITERS and len(cell["warmup"]) == 1
        if path == "unmerged":
            assert cell["descriptors"] * PAGE_BYTES == 2 * cell["bytes"]  # one per (layer, plane, block) of full blocks
        elif path in ("merged", "prepped") and ids == "consecutive":
            assert cell["descriptors"] == LAYERS  # one per layer (prepped: after NIXL merges list neighbours)
        elif path != "copy":
            assert LAYERS <= cell["descriptors"] <= LAYERS * blocks


def test_timings_are_measured_and_consistent(cpu_run):
    result, stdout = cpu_run
    for cell in result["transfers"]:
        for sample in cell["samples"] + cell["warmup"]:
            assert all(math.isfinite(v) and v >= 0 for v in sample.values()), sample
            assert sample["done_ms"] > 0
            if cell["path"] != "copy":
                assert sample["done_ms"] >= sample["post_ms"] > 0  # DONE is timed from the same start as the post
        assert cell["p90_notif_ms"] >= cell["p50_notif_ms"] > 0
    writes = [c for c in result["transfers"] if c["path"] != "copy"]
    assert len(result["summary"]) == len([c for c in writes if c["ids"] == "consecutive"]) + len([c for c in writes if c["ids"] == "random"])
    assert all(math.isfinite(s["fraction_p50"]) and s["fraction_p50"] > 0 and s["host_us_p50"] > 0 for s in result["summary"])
    assert result["connect_ms"] > 0 and result["prepare_ms"] > 0
    assert "->notif p50" in stdout and stdout.count(" yes") == len(result["transfers"])


def test_verification_catches_wrong_and_stray_bytes():
    from bench import gpu_common as bench

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


def test_progressive_benchmark_moves_every_layer_in_parts(tmp_path):
    """bench/gpu_progressive.py on CPU DRAM: whole, progressive and one-layer WRITEs land verified, with a tail measured."""
    pytest.importorskip("nixl")
    out = tmp_path / "progressive.json"
    command = [sys.executable, "-m", "bench.gpu_progressive", "--device", "cpu", "--tokens", "30", "--layers", str(LAYERS),
               "--kv-heads", str(HEADS), "--head-size", str(HEAD_SIZE), "--block-size", str(BLOCK_SIZE), "--hidden", "16", "--ffn", "16",
               "--iters", str(ITERS), "--warmup", "1", "--timeout", "30", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    cells = {c["mode"]: c for c in result["cells"]}
    assert set(cells) == {"whole", "progressive", "one-layer"} and all(c["verified"] for c in cells.values())
    assert [s["parts"] for s in cells["progressive"]["samples"]] == [LAYERS] * ITERS
    assert cells["whole"]["samples"][0]["layers_moved"] == LAYERS and cells["one-layer"]["samples"][0]["layers_moved"] == 1
    for cell in cells.values():
        for sample in cell["samples"]:
            # D may see the last notification before P's post call has returned: both follow the compute's end.
            assert 0 < sample["compute_ms"] <= min(sample["last_post_ms"], sample["last_notif_ms"]) and sample["tail_ms"] > 0
