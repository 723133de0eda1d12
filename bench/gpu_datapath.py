# SPDX-License-Identifier: Apache-2.0
"""Data-plane benchmark of kvpush's transfer path: one NIXL WRITE of a request's KV, P to D, against a copy timed the same way.

Two processes, a producer P (this process) and a consumer D (a spawned
child), each hold a KV cache in the layout vLLM's FLASH_ATTN backend hands
over (bench/gpu_common.py). The default geometry is one TP8 rank of
Qwen3-32B: 64 layers, 1 local KV head of 128 bf16 channels, blocks of 16
tokens. D may sit on another device (--d-device): P's descriptors then name
D's device for D's memory, as the connector's do.

Per cell (prompt length, block ids, path, D's work), after warm-ups, every
sample is timed the same way for the WRITE and for the copy it is compared
with: D does its work (`fill`: poisons its whole cache, so the GPU last ran
D's context, as a decode engine's does; `idle`: nothing between samples),
acknowledges, and P times from just before the post (the copy's launch) to
the completion seen on the host: the WRITE's DONE on P and its notification
on D (one system-wide monotonic clock); the copy's `torch.cuda.synchronize`.
The copy moves the same bytes into a buffer of D's, mapped into P by CUDA
IPC (a peer copy when D is on another GPU). It is also timed with CUDA
events, without launch, sync or context switch: a lower bound no host-side
path reaches.

Paths: `merged` builds the plan and its descriptor lists per request
(`build_plan`, `KvAgent.make_write`); `prepped` posts page entries into
descriptor lists prepared once per peer (`page_write`, `KvAgent.make_pages`,
what the connector does when both sides lay pages out alike); `unmerged`
splits the plan into one descriptor per block row run. D verifies every
transferred token and every other byte of its cache (in `idle` cells, once,
after the last sample). Prints p50 and p90 per cell and the fraction of the
copy; writes every sample to --out (after every cell).

    python bench/gpu_datapath.py --out runs/gpu_datapath.json                      # one GPU
    python bench/gpu_datapath.py --d-device 1 --out runs/gpu_datapath_2gpu.json    # D on a second GPU
    python bench/gpu_datapath.py --device cpu --tokens 64,256 --layers 4 --out x.json  # CPU DRAM
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass

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
from kvpush.layout.pages import merged_count, page_write
from kvpush.layout.plan import build_plan, unmerged_plan
from kvpush.report.percentiles import percentile

TARGETS = {16384: 0.90, 65536: 0.95}  # fraction of the copy, fairly timed
TARGET_HOST_US = 20.0  # per-WRITE host time on the critical path
PATHS = ("merged", "prepped", "unmerged")
ID_KINDS = ("consecutive", "random")
D_WORK = ("fill", "idle")
COPY = "copy"


@dataclass
class Sample:
    """One timed transfer, in milliseconds: the plan build, making the WRITE, posting it; the rest from just before making it."""

    plan_ms: float
    make_ms: float  # make_write / make_pages: what the connector does while the forward runs
    post_ms: float  # start: what is left at the forward's end for a WRITE made ahead
    done_ms: float  # until P sees DONE (the copy: until synchronize returns)
    notif_ms: float  # until D holds the notification (the copy: as done_ms)


def block_ids(kind: str, blocks: int, num_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """P's and D's block ids for a request; block 0 is vLLM's null block and is never handed out."""
    if kind == "consecutive":
        ids = np.arange(1, blocks + 1, dtype=np.int64)
        return ids, ids.copy()
    return (rng.permutation(np.arange(1, num_blocks, dtype=np.int64))[:blocks],
            rng.permutation(np.arange(1, num_blocks, dtype=np.int64))[:blocks])


class Producer(ProducerSide):
    """P: one verified WRITE (or copy) per call, timed as the module says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        largest = self.geometry.transfer_bytes(self.geometry.num_blocks * self.geometry.block_size // 2)
        self.copy_source = torch.randint(0, 256, (largest,), dtype=torch.uint8, device=self.device)
        self.copy_target = self.ipc_target if self.ipc_target is not None else torch.empty_like(self.copy_source)

    def transfer(self, path: str, src_ids: np.ndarray, dst_ids: np.ndarray, tokens: int, seed: int, *, fill: bool, verify: bool):
        """(sample, descriptors, bytes, D's verdict or None)."""
        self.transfers += 1
        g = self.geometry
        notif = f"kvpush-bench|{self.transfers}"
        notifs = [] if path == COPY else [notif]
        self.link.send("expect", notifs, seed, dst_ids.tolist(), g.moved_tokens(tokens), fill, verify)
        if path != COPY:
            self.fill(seed, src_ids)
        self.link.receive("ready")
        t0 = time.monotonic_ns()
        if path == COPY:
            nbytes = g.transfer_bytes(tokens)
            self.copy_target[:nbytes].copy_(self.copy_source[:nbytes])
            synchronize(self.device)
            t3 = time.monotonic_ns()
            _, verdict, strays = self.link.receive("result")
            ms = (t3 - t0) / 1e6
            return Sample(0.0, 0.0, 0.0, ms, ms), 1, nbytes, verdict
        src, dst = g.side(self.planes, src_ids), g.side(self.peer_planes, dst_ids)
        if path == "prepped":
            pages = page_write(src, dst, self.local_pages, self.peer_pages, (0, tokens))
            t1 = time.monotonic_ns()
            write = self.agent.make_pages(self.peer, self.local_prepared, pages.local, self.peer_prepared, pages.remote, pages.bytes,
                                          notif.encode())
        else:
            plan = build_plan(src, dst, (0, tokens), (0, g.heads))
            if path == "unmerged":
                plan = unmerged_plan(plan.src, plan.dst, plan.lengths, g.row_run_bytes)
            t1 = time.monotonic_ns()
            write = self.agent.make_write(self.peer, plan.src, plan.dst, plan.lengths, self.device_index, self.peer_device, notif.encode())
        t_made = time.monotonic_ns()
        self.agent.start(write)
        t2 = time.monotonic_ns()
        deadline = time.monotonic() + self.timeout_s
        while (state := self.agent.poll(write)) == "PROC":  # spin: this is the timed path
            if time.monotonic() > deadline:
                raise TimeoutError(f"WRITE {notif} still in flight after {self.timeout_s} s")
        t3 = time.monotonic_ns()
        self.agent.release(write)
        if state != "DONE":
            raise RuntimeError(f"WRITE {notif} ended in state {state}")
        [notified_ns], verdict, strays = self.link.receive("result")
        if strays:
            raise RuntimeError(f"D got notifications it did not expect: {strays}")
        descriptors = merged_count(pages, self.local_pages, self.peer_pages) if path == "prepped" else len(plan)
        nbytes = pages.bytes if path == "prepped" else plan.total_bytes
        return (Sample((t1 - t0) / 1e6, (t_made - t1) / 1e6, (t2 - t_made) / 1e6, (t3 - t1) / 1e6, (notified_ns - t1) / 1e6),
                descriptors, nbytes, verdict)


def measure_cell(producer: Producer, path: str, kind: str, tokens: int, ids, d_work: str, args) -> dict:
    """Warm-ups plus timed samples of one cell; D verifies each (fill) or the last (idle)."""
    cell = {"tokens": tokens, "ids": kind, "path": path, "d_work": d_work, "blocks": len(ids[0]), "warmup": [], "samples": [], "failures": []}
    total = args.warmup + args.iters
    for i in range(total):
        seed = args.seed * 1_000_003 + producer.transfers
        fill = d_work == "fill" or i == 0
        verify = path != COPY and (d_work == "fill" or i == total - 1)
        sample, descriptors, nbytes, verdict = producer.transfer(path, ids[0], ids[1], tokens, seed, fill=fill, verify=verify)
        cell["warmup" if i < args.warmup else "samples"].append(asdict(sample))
        if verdict is not None and not Verdict(**verdict).ok:
            cell["failures"].append(verdict)
    if path == COPY:
        nbytes = producer.geometry.transfer_bytes(tokens)
        cell["verified"] = bool(torch.equal(producer.copy_target[:nbytes], producer.copy_source[:nbytes]))
    else:
        cell["verified"] = not cell["failures"] and nbytes == producer.geometry.transfer_bytes(tokens)
    cell.update(bytes=nbytes, descriptors=descriptors)
    for field in ("plan_ms", "make_ms", "post_ms", "done_ms", "notif_ms"):
        values = [s[field] for s in cell["samples"]]
        cell[f"p50_{field}"], cell[f"p90_{field}"] = median(values), percentile(values, 90)
    print(f"  {tokens:>6} {kind:<11} {path:<8} D {d_work:<4} {descriptors:>7} descs  notif p50 {cell['p50_notif_ms']:8.3f} ms "
          f"p90 {cell['p90_notif_ms']:8.3f}  {'ok' if cell['verified'] else 'WRONG BYTES'}", flush=True)
    return cell


def time_event_copies(device: torch.device, sizes: list[int], target: torch.Tensor, source: torch.Tensor, reps: int, warmup: int) -> list[dict]:
    """Each size's copy into D's buffer timed with CUDA events (no launch, no sync, no context switch): a lower bound."""
    rows = []
    for nbytes in sizes:
        src, dst = source[:nbytes], target[:nbytes]
        for _ in range(warmup):
            dst.copy_(src)
        times_ms = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
        rows.append({"bytes": nbytes, "samples_ms": times_ms, "p50_ms": median(times_ms), "p90_ms": percentile(times_ms, 90)})
    return rows


def run(args: argparse.Namespace, save) -> dict:
    """The whole benchmark; `save(result)` is called after every cell, so a failure keeps what was measured."""
    cuda = args.device == "cuda"
    device, d_device = devices(args)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    random_tokens = [int(t) for t in args.random_tokens.split(",")] if args.random_tokens else tokens_list
    block_counts = {t: -(-t // args.block_size) for t in tokens_list + random_tokens}
    num_blocks = args.num_blocks or 2 * max(block_counts.values()) + 1
    geometry = Geometry(args.layers, args.kv_heads, args.head_size, args.block_size, num_blocks, block_major=args.layout == "block-major")
    rng = np.random.default_rng(args.seed)
    cells = [(t, "consecutive") for t in tokens_list if "consecutive" in args.ids] + [(t, "random") for t in random_tokens if "random" in args.ids]
    ids = {cell: block_ids(cell[1], block_counts[cell[0]], num_blocks, rng) for cell in cells}
    result = {"environment": environment(device), "device": str(device), "d_device": str(d_device), "geometry": asdict(geometry),
              "args": vars(args), "connect_ms": None, "prepare_ms": None, "ipc_error": None, "event_copies": [], "transfers": [],
              "summary": [], "complete": False, "error": None}

    def producer_side(conn) -> None:
        producer = Producer(conn, geometry, device, args.timeout, args.nixl_progress_thread_ms)
        result.update(connect_ms=producer.connect_ms, prepare_ms=producer.prepare_ms, ipc_error=producer.ipc_error)
        if cuda:
            sizes = sorted({geometry.transfer_bytes(t) for t in tokens_list})
            result["event_copies"] = time_event_copies(device, sizes, producer.copy_target, producer.copy_source, args.iters, args.warmup)
        for d_work in args.d_work.split(","):
            for tokens, kind in cells:
                for path in ([COPY] if kind == "consecutive" else []) + args.paths.split(","):
                    result["transfers"].append(measure_cell(producer, path, kind, tokens, ids[(tokens, kind)], d_work, args))
                    result["summary"] = summarize(result)
                    save(result)
        producer.close()

    ipc_bytes = geometry.transfer_bytes(num_blocks * args.block_size // 2) if cuda and not args.no_ipc else 0
    run_session(args, geometry, result, save, producer_side, ipc_bytes=ipc_bytes)
    result["verified"] = all(c["verified"] for c in result["transfers"])
    save(result)
    return result


def summarize(result: dict) -> list[dict]:
    """Each WRITE cell against the host-timed copy of the same bytes with the same D work (p50/p50 and p90/p90)."""
    copies = {(c["tokens"], c["d_work"]): c for c in result["transfers"] if c["path"] == COPY}
    events = {c["bytes"]: c for c in result["event_copies"]}
    rows = []
    for cell in result["transfers"]:
        copy = copies.get((cell["tokens"], cell["d_work"]))
        if cell["path"] == COPY or copy is None:
            continue
        row = {"tokens": cell["tokens"], "ids": cell["ids"], "path": cell["path"], "d_work": cell["d_work"],
               "fraction_p50": copy["p50_done_ms"] / cell["p50_notif_ms"], "fraction_p90": copy["p90_done_ms"] / cell["p90_notif_ms"],
               "host_us_p50": 1000 * (cell["p50_plan_ms"] + cell["p50_make_ms"] + cell["p50_post_ms"]),
               "post_us_p50": 1000 * cell["p50_post_ms"]}
        if cell["bytes"] in events:
            row["fraction_of_event_copy"] = events[cell["bytes"]]["p50_ms"] / cell["p50_notif_ms"]
        target = TARGETS.get(cell["tokens"])
        row["target"] = target
        row["meets_target"] = target is None or row["fraction_p50"] >= target
        rows.append(row)
    return rows


def format_table(result: dict) -> str:
    summary = {(s["tokens"], s["ids"], s["path"], s["d_work"]): s for s in result["summary"]}
    events = {c["bytes"]: c for c in result["event_copies"]}
    header = (f"{'D':<4} {'tokens':>6} {'block ids':<11} {'path':<8} {'MiB':>7} {'descs':>7} {'host us':>8} {'post us':>8} {'->DONE p50':>10} "
              f"{'->notif p50':>11} {'p90':>8} {'% copy p50':>10} {'p90':>6} {'% event':>7} ok")
    lines = [header, "-" * len(header)]
    for c in result["transfers"]:
        s = summary.get((c["tokens"], c["ids"], c["path"], c["d_work"]), {})
        event = events.get(c["bytes"]) if c["path"] == COPY else None
        host = f"{s['host_us_p50']:8.1f} {s['post_us_p50']:8.1f}" if s else f"{'-':>8} {'-':>8}"
        note = f" (event-timed copy {event['p50_ms']:.3f} ms)" if event else ""
        lines.append(f"{c['d_work']:<4} {c['tokens']:>6} {c['ids']:<11} {c['path']:<8} {c['bytes'] / 2**20:7.1f} {c['descriptors']:>7} {host} "
                     f"{c['p50_done_ms']:10.3f} {c['p50_notif_ms']:11.3f} {c['p90_notif_ms']:8.3f} {_percent(s, 'fraction_p50'):>10} "
                     f"{_percent(s, 'fraction_p90'):>6} {_percent(s, 'fraction_of_event_copy'):>7} {'yes' if c['verified'] else 'NO'}{note}")
    lines.append("Times from just before the post (the copy's launch) to completion seen on the host: ->DONE on P, ->notif on D; "
                 "the copy moves the same bytes into D's memory after the same D work and handshake. host us = plan + make + post calls; post us = the post call alone, what is left at the forward's end "
                 "when the connector made the WRITE while the forward ran (non-progressive push). "
                 f"Targets: >= {', '.join(f'{v:.0%} at {k}' for k, v in TARGETS.items())} tokens; host <= {TARGET_HOST_US:g} us.")
    return "\n".join(lines)


def _percent(row: dict, key: str) -> str:
    return f"{100 * row[key]:5.1f}%" if key in row else "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser, seed=20261129)
    parser.add_argument("--tokens", default="1024,4096,16384,32768,65536", help="prompt lengths, consecutive block ids")
    parser.add_argument("--random-tokens", default="1024,16384", help="prompt lengths with randomly permuted block ids")
    parser.add_argument("--layout", choices=("layer-major", "block-major"), default="layer-major",
                        help="KV cache allocation: each layer's blocks together (vLLM's default) or each block's layers together")
    parser.add_argument("--num-blocks", type=int, default=0, help="blocks in each pool; default twice the largest request, plus block 0")
    parser.add_argument("--paths", default="merged,prepped")
    parser.add_argument("--ids", default=",".join(ID_KINDS))
    parser.add_argument("--d-work", default=",".join(D_WORK), help="what D does between samples: fill (poison its cache), idle")
    parser.add_argument("--no-ipc", action="store_true", help="copy within P instead of into D's memory through CUDA IPC")
    args = parser.parse_args(argv)
    for name, allowed in (("paths", PATHS), ("ids", ID_KINDS), ("d_work", D_WORK)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            parser.error(f"--{name.replace('_', '-')}: unknown {sorted(unknown)}; choose from {allowed}")
    return check_common_options(parser, args)


def report_lines(result: dict) -> list[str]:
    lines = []
    if result["connect_ms"] is not None:
        lines.append(f"connection setup (add_peer + hello seen by D): {result['connect_ms']:.1f} ms; "
                     f"page tables prepared in {result['prepare_ms']:.2f} ms")
    if result["ipc_error"]:
        lines.append(f"no copy through CUDA IPC: {result['ipc_error']}")
    return [*lines, format_table(result)]


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all verified, 1 some bytes were wrong, 2 the run broke off (what was measured is in --out)."""
    return run_and_report(parse_args(argv), run, report_lines)


if __name__ == "__main__":
    sys.exit(main())
