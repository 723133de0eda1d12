# SPDX-License-Identifier: Apache-2.0
"""Layer-progressive push on a GPU: how much of the KV transfer is left after the last layer is computed.

P (this process) runs a simulated prefill: per layer, matmuls sized like one
TP8 rank of Qwen3-32B (two [tokens, 5120] x [5120, 6144] bf16 products, about
a layer's dense FLOPs; attention is left out), each layer's completion
recorded as a CUDA event. A transfer thread, as the connector's is, waits
for each layer's event and then either posts that layer's KV as one WRITE
part (progressive: every layer but the last, which goes last with the
notification naming the part count) or, without progression, posts the
whole KV in one WRITE after the last layer. Both use kvpush's prepared page
tables (KvAgent.make_pages and start, page_write over the layers of the part). D (a
spawned child) poisons its cache before each sample, counts every part's
notification and verifies every byte.

The critical-path tail is from the moment the transfer thread sees the last
layer's event complete to D's last notification (one monotonic clock). The
target: the progressive tail is at most one layer's WRITE, timed alone with
nothing computing.

    python -m bench.gpu_progressive --out runs/gpu_progressive.json
    python -m bench.gpu_progressive --device cpu --tokens 64 --layers 4 --hidden 64 --ffn 64 --out x.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
from dataclasses import asdict

import numpy as np
import torch

from bench.gpu_common import (
    Geometry,
    ProducerSide,
    Verdict,
    add_common_options,
    check_common_options,
    devices,
    environment,
    median,
    run_and_report,
    run_session,
    synchronize,
)
from kvpush.layout.pages import page_write
from kvpush.report.percentiles import percentile

MODES = ("whole", "progressive", "one-layer")
POLL_S = 0.0005  # the connector's poll_interval_ms while a WRITE is in flight


class LayerDone:
    """A layer's compute, finished: on GPU a CUDA event recorded after its kernels were launched (the connector's save_kv_layer
    records one before handing the layer over), waited on only once recorded; on CPU compute is synchronous."""

    def __init__(self, cuda: bool):
        self._event = torch.cuda.Event() if cuda else None
        self._recorded = threading.Event()

    def mark(self) -> None:
        if self._event is not None:
            self._event.record()
        self._recorded.set()

    def wait(self, timeout_s: float, progress) -> None:
        """Waits, calling progress() meanwhile: with no NIXL progress thread, the parts in flight advance only when polled,
        as the connector's transfer thread polls them every poll interval while a WRITE is in flight."""
        deadline = time.monotonic() + timeout_s
        while not self._recorded.is_set() or (self._event is not None and not self._event.query()):
            progress()
            if time.monotonic() > deadline:
                raise TimeoutError("a layer never finished")
            time.sleep(POLL_S)


class Producer(ProducerSide):
    """P: a simulated prefill with its WRITE, whole or in parts."""

    def __init__(self, conn, geometry: Geometry, device: torch.device, timeout_s: float, hidden: int, ffn: int, tokens: int,
                 progress_thread_ms: int = 0):
        super().__init__(conn, geometry, device, timeout_s, progress_thread_ms)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.activations = torch.randn(tokens, hidden, dtype=dtype, device=device)
        self.weights = [torch.randn(hidden, ffn, dtype=dtype, device=device) / hidden**0.5 for _ in range(2)]

    def _compute_layer(self, tokens: int) -> None:
        x = self.activations[:tokens]
        for w in self.weights:
            torch.matmul(x, w)

    def sample(self, mode: str, ids: np.ndarray, tokens: int, seed: int) -> dict:
        """One verified prefill + transfer; times in ms from the prefill's start."""
        self.transfers += 1
        g = self.geometry
        layers = list(range(g.layers))
        parts = [[layer] for layer in layers] if mode == "progressive" else [layers] if mode == "whole" else [[0]]
        notifs = [f"kvpush-bench|{self.transfers}|{i + 1}|{len(parts) if i == len(parts) - 1 else 0}" for i in range(len(parts))]
        moved_layers = sorted({layer for part in parts for layer in part})
        self.link.send("expect", notifs, seed, ids.tolist(), g.moved_tokens(tokens), True, mode != "one-layer")
        self.fill(seed, ids)
        self.link.receive("ready")
        src, dst = g.side(self.planes, ids), g.side(self.peer_planes, ids)
        done = [LayerDone(self.device.type == "cuda") for _ in layers]
        marks: dict[str, int] = {}
        writes, failure = [], []

        def transfer() -> None:
            try:
                def progress() -> None:
                    for w in writes:
                        self.agent.poll(w)

                for index, part in enumerate(parts):
                    for layer in part if mode != "one-layer" else ():
                        done[layer].wait(self.timeout_s, progress)
                    if index == len(parts) - 1:
                        marks["compute_end"] = time.monotonic_ns()
                    pages = page_write(src, dst, self.local_pages, self.peer_pages, (0, tokens), frozenset(part))
                    write = self.agent.make_pages(self.peer, self.local_prepared, pages.local, self.peer_prepared, pages.remote,
                                                  pages.bytes, notifs[index].encode())
                    self.agent.start(write)
                    writes.append(write)
                marks["last_post"] = time.monotonic_ns()
                deadline = time.monotonic() + self.timeout_s
                while any(self.agent.poll(w) == "PROC" for w in writes):
                    if time.monotonic() > deadline:
                        raise TimeoutError("a WRITE part never completed")
                states = [self.agent.poll(w) for w in writes]
                for w in writes:
                    self.agent.release(w)
                if set(states) != {"DONE"}:
                    raise RuntimeError(f"WRITE parts ended {states}")
            except Exception:
                failure.append(traceback.format_exc())

        marks["start"] = time.monotonic_ns()
        thread = threading.Thread(target=transfer, name="kvpush-bench-transfer")
        thread.start()
        if mode != "one-layer":
            for layer in layers:
                self._compute_layer(tokens)
                done[layer].mark()
        thread.join(self.timeout_s)
        synchronize(self.device)
        arrived, verdict, strays = self.link.receive("result")
        if failure or thread.is_alive():
            raise RuntimeError(failure[0] if failure else "the transfer thread hung")
        if strays:
            raise RuntimeError(f"D got notifications it did not expect: {strays}")
        ms = lambda ns: (ns - marks["start"]) / 1e6  # noqa: E731
        return {"compute_ms": ms(marks["compute_end"]), "last_post_ms": ms(marks["last_post"]), "last_notif_ms": ms(max(arrived)),
                "tail_ms": (max(arrived) - marks["compute_end"]) / 1e6, "parts": len(parts), "layers_moved": len(moved_layers),
                "verdict": verdict}


def run(args: argparse.Namespace, save) -> dict:
    device, d_device = devices(args)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * -(-max(tokens_list) // args.block_size) + 1
    geometry = Geometry(args.layers, args.kv_heads, args.head_size, args.block_size, num_blocks)
    result = {"environment": environment(device), "device": str(device), "d_device": str(d_device), "geometry": asdict(geometry),
              "args": vars(args), "cells": [], "complete": False, "error": None}

    def producer_side(conn) -> None:
        producer = Producer(conn, geometry, device, args.timeout, args.hidden, args.ffn, max(tokens_list), args.nixl_progress_thread_ms)
        for tokens in tokens_list:
            ids = np.arange(1, -(-tokens // args.block_size) + 1, dtype=np.int64)
            for mode in MODES:
                result["cells"].append(measure_cell(producer, mode, ids, tokens, args))
                save(result)
        producer.close()

    run_session(args, geometry, result, save, producer_side)
    result["verified"] = all(c["verified"] for c in result["cells"])
    save(result)
    return result


def measure_cell(producer: Producer, mode: str, ids: np.ndarray, tokens: int, args: argparse.Namespace) -> dict:
    """Warm-ups plus timed samples of one (prompt length, mode), each verified by D."""
    cell = {"tokens": tokens, "mode": mode, "samples": [], "failures": []}
    for i in range(args.warmup + args.iters):
        sample = producer.sample(mode, ids, tokens, args.seed + producer.transfers)
        if sample["verdict"] is not None and not Verdict(**sample["verdict"]).ok:
            cell["failures"].append(sample["verdict"])
        if i >= args.warmup:
            cell["samples"].append(sample)
    for key in ("compute_ms", "tail_ms", "last_notif_ms"):
        values = [s[key] for s in cell["samples"]]
        cell[f"p50_{key}"], cell[f"p90_{key}"] = median(values), percentile(values, 90)
    cell["verified"] = not cell["failures"]
    print(f"  {tokens:>6} {mode:<11} compute p50 {cell['p50_compute_ms']:9.3f} ms  tail p50 {cell['p50_tail_ms']:8.3f} "
          f"p90 {cell['p90_tail_ms']:8.3f} ms  {'ok' if cell['verified'] else 'WRONG BYTES'}", flush=True)
    return cell


def format_table(result: dict) -> str:
    cells = {(c["tokens"], c["mode"]): c for c in result["cells"]}
    header = f"{'tokens':>6} {'prefill ms':>10} {'tail whole p50':>14} {'p90':>7} {'tail progressive p50':>20} {'p90':>7} {'one layer p50':>13} target ok"
    lines = [header, "-" * len(header)]
    for tokens in dict.fromkeys(c["tokens"] for c in result["cells"]):
        whole, progressive, one = (cells.get((tokens, m)) for m in MODES)
        if not (whole and progressive and one):
            continue
        met = progressive["p50_tail_ms"] <= one["p50_tail_ms"]
        lines.append(f"{tokens:>6} {whole['p50_compute_ms']:10.2f} {whole['p50_tail_ms']:14.3f} {whole['p90_tail_ms']:7.3f} "
                     f"{progressive['p50_tail_ms']:20.3f} {progressive['p90_tail_ms']:7.3f} {one['p50_tail_ms']:13.3f} "
                     f"{'met' if met else 'NOT met':>6} {'yes' if whole['verified'] and progressive['verified'] and one['verified'] else 'NO'}")
    lines.append("tail: last layer's compute seen complete -> D's last notification. one layer: a WRITE of one layer's KV, "
                 "nothing computing (post -> notification). Target: progressive tail <= one layer's WRITE.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser, seed=20261201)
    parser.add_argument("--tokens", default="4096,16384,65536")
    parser.add_argument("--hidden", type=int, default=5120, help="the simulated layer's input width (Qwen3-32B: 5120)")
    parser.add_argument("--ffn", type=int, default=6144, help="the simulated layer's output width per matmul")
    return check_common_options(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all verified, 1 some bytes were wrong, 2 the run broke off (what was measured is in --out)."""
    return run_and_report(parse_args(argv), run, lambda result: [format_table(result)])


if __name__ == "__main__":
    sys.exit(main())
