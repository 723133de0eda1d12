# SPDX-License-Identifier: Apache-2.0
"""Data-plane benchmark of kvpush's transfer path: one NIXL WRITE of a request's KV, P to D.

Two processes on one device, a producer P (this process) and a consumer D (a
spawned child), each hold a KV cache in the layout vLLM's FLASH_ATTN backend
hands over: one allocation sliced per layer, each layer a logical
[num_blocks, local_kv_heads, block_size, 2*head_size] tensor (keys in the first
head_size channels, values in the rest). The default geometry is one TP8 rank
of Qwen3-32B: 64 layers, 1 local KV head of 128 bf16 channels, blocks of 16
tokens.

For each prompt length, and for consecutive block ids (a fresh engine) and
randomly permuted ones (a fragmented pool), P fills its blocks with seeded
random bits, builds the plan with kvpush's `build_plan`, posts ONE
`KvAgent.post_write` with a notification and polls it to DONE; D, which
poisoned its whole cache beforehand, spins on `notifications()` until it
arrives, then checks every transferred token of every layer against the same
seeded bits and every other byte of its cache for stray writes. Paths compared
on the same bytes: the merged plan (kvpush's), the plan split into one
descriptor per block-sized row run (no merging), and a torch `copy_` of one
contiguous buffer of the same size, within P and, on CUDA, into a buffer of D
mapped through CUDA IPC. Prints a table and writes every sample to --out as
JSON (after every cell, so a run that breaks off keeps what it measured).
docs/gpu-datapath.md has the H200 results and the commands.

    python bench/gpu_datapath.py --out runs/gpu_datapath.json                      # H200
    python bench/gpu_datapath.py --device cpu --tokens 64,256 --layers 4 --out x.json  # CPU DRAM
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from kvpush.connector.nixl_agent import HELLO, KvAgent, MemoryRange
from kvpush.layout.geometry import Plane, describe_layer
from kvpush.layout.plan import Plan, Side, build_plan, unmerged_plan

POISON = -1  # int16 bits D fills its cache with before each transfer (a bf16 NaN)
NOTIF_PREFIX = "kvpush-bench"
IDLE_SLEEP_S = 50e-6  # between checks while waiting for the other process (not while timing)
TARGET_FRACTION_OF_COPY = 0.70
PATHS = ("merged", "unmerged")
ID_KINDS = ("consecutive", "random")


@dataclass(frozen=True)
class Geometry:
    """One worker's KV cache: layers × [num_blocks, heads, block_size, 2*head_size] of `element`-byte values."""

    layers: int
    heads: int
    head_size: int
    block_size: int
    num_blocks: int
    element: int = 2  # bf16
    block_major: bool = False  # one allocation [blocks, layers, ...]: a block's pages of all layers side by side

    @property
    def page_bytes(self) -> int:
        """One block of one layer, keys and values."""
        return self.heads * self.block_size * 2 * self.head_size * self.element

    @property
    def row_run_bytes(self) -> int:
        """block_size rows of one head: the unit of the unmerged plan, one per (layer, plane, block) in count."""
        return self.block_size * self.head_size * self.element

    def moved_tokens(self, tokens: int) -> int:
        """Tokens a WRITE of a `tokens`-token prompt moves: whole blocks, the last partly filled one too."""
        return -(-tokens // self.block_size) * self.block_size

    def transfer_bytes(self, tokens: int) -> int:
        """Keys and values of the moved tokens of every layer and local head."""
        return self.layers * self.moved_tokens(tokens) * self.heads * 2 * self.head_size * self.element


def allocate_cache(geometry: Geometry, device: torch.device) -> torch.Tensor:
    """A [layers, num_blocks, heads, block_size, 2*head_size] bf16 view of one allocation.

    Layer-major (vLLM's default) stores each layer's blocks together;
    block-major stores each block's pages of all layers together, so a
    request on consecutive blocks is one contiguous region.
    """
    g = geometry
    if g.block_major:
        shape = (g.num_blocks, g.layers, g.heads, g.block_size, 2 * g.head_size)
        return torch.empty(shape, dtype=torch.bfloat16, device=device).transpose(0, 1)
    return torch.empty((g.layers, g.num_blocks, g.heads, g.block_size, 2 * g.head_size), dtype=torch.bfloat16, device=device)


def cache_planes(cache: torch.Tensor, geometry: Geometry) -> list[Plane]:
    """The key and value planes of every layer, described the way the connector describes vLLM's tensors."""
    planes: list[Plane] = []
    for layer in range(geometry.layers):
        view = cache[layer]
        planes += describe_layer("FLASH_ATTN", tuple(view.shape), tuple(view.stride()), view.data_ptr(), view.element_size(),
                                 num_blocks=geometry.num_blocks, block_size=geometry.block_size,
                                 num_local_heads=geometry.heads, head_size=geometry.head_size, layer_index=layer)
    return planes


def make_agent(name: str, cache: torch.Tensor) -> KvAgent:
    agent = KvAgent(name, ["UCX"], "VRAM" if cache.is_cuda else "DRAM")
    agent.register([MemoryRange(cache.data_ptr(), cache.nbytes, cache.device.index or 0)])
    return agent


def seeded_bits(seed: int, geometry: Geometry, blocks: int, device: torch.device) -> torch.Tensor:
    """Random int16 bits for `blocks` blocks of every layer; both processes derive the same from the seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (geometry.layers, blocks, geometry.heads, geometry.block_size, 2 * geometry.head_size)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device, generator=generator)


@dataclass
class Verdict:
    """What D found after a transfer: wrong elements per layer, and blocks changed outside the transferred tokens."""

    mismatched_elements_by_layer: dict[int, int]
    stray_blocks: int

    @property
    def ok(self) -> bool:
        return not self.mismatched_elements_by_layer and self.stray_blocks == 0


def verify_blocks(cache_bits: torch.Tensor, dst_ids: torch.Tensor, expected: torch.Tensor, tokens: int) -> Verdict:
    """Checks D's cache after a transfer of `tokens` tokens into blocks `dst_ids` (in token order).

    Every transferred token of every layer must equal `expected`; everything
    else (the last block's tail, every other block) must still hold POISON.
    """
    got = cache_bits.index_select(1, dst_ids)
    block_size = cache_bits.shape[3]
    token = torch.arange(len(dst_ids) * block_size, device=cache_bits.device).view(1, -1, 1, block_size, 1)
    moved = token < tokens
    wrong = ((got != expected) & moved).flatten(1).sum(1).tolist()
    stray_in_destination = ((got != POISON) & ~moved).flatten(2).any(2).any(0)
    others = torch.ones(cache_bits.shape[1], dtype=torch.bool, device=cache_bits.device)
    others[dst_ids] = False
    stray_elsewhere = (cache_bits[:, others] != POISON).flatten(2).any(2).any(0)
    return Verdict({layer: int(n) for layer, n in enumerate(wrong) if n}, int(stray_in_destination.sum() + stray_elsewhere.sum()))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeerFailed(RuntimeError):
    """The other process reported an exception."""


class Link:
    """The pipe between P and D; every wait is bounded and keeps the local NIXL agent progressing."""

    def __init__(self, conn, agent: KvAgent, timeout_s: float):
        self.conn = conn
        self.agent = agent
        self.timeout_s = timeout_s
        self.stray_notifications: list[tuple[str, bytes]] = []

    def send(self, *message) -> None:
        self.conn.send(message)

    def receive(self, kind: str):
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0):
            self.progress()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} message within {self.timeout_s} s")
            time.sleep(IDLE_SLEEP_S)
        message = self.conn.recv()
        if message[0] == "error":
            raise PeerFailed(f"the other process failed:\n{message[1]}")
        if message[0] != kind:
            raise RuntimeError(f"expected a {kind!r} message, got {message[0]!r}")
        return message[1:]

    def progress(self) -> None:
        for sender, messages in self.agent.notifications().items():
            self.stray_notifications += [(sender, m) for m in messages if m != HELLO]


# ---- D: the consumer process ------------------------------------------------------------


def consumer_main(conn, options: dict) -> None:
    """D: registers its cache, then per transfer poisons, acknowledges, waits for the notification and verifies."""
    try:
        run_consumer(conn, options)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def run_consumer(conn, options: dict) -> None:
    device = torch.device(options["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # two processes share the cores; the producer's copies are single-threaded too
    geometry = Geometry(**options["geometry"])
    cache = allocate_cache(geometry, device)
    bits = cache.view(torch.int16)
    agent = make_agent(f"{NOTIF_PREFIX}-d-{os.getpid()}", cache)
    link = Link(conn, agent, options["timeout_s"])
    link.send("hello", agent.name, agent.metadata(), cache_planes(cache, geometry))
    saw_hello = False
    deadline = time.monotonic() + options["timeout_s"]
    while not saw_hello:  # first contact: P's hello notification completes the connection
        for messages in agent.notifications().values():
            saw_hello = saw_hello or HELLO in messages
        if time.monotonic() > deadline:
            raise TimeoutError("P's hello notification never arrived")
        time.sleep(IDLE_SLEEP_S)
    link.send("connected")
    # A buffer outside the registered cache, so torch's IPC mapping of it never meets UCX's mapping of the cache.
    ipc_target = torch.empty(options["ipc_bytes"], dtype=torch.uint8, device=device) if options["ipc_bytes"] else None
    try:
        link.send("ipc", ipc_target, None)
    except Exception as exc:  # no IPC handle for this memory: P times its copy within its own memory only
        link.send("ipc", None, repr(exc))
    while True:
        deadline = time.monotonic() + options["timeout_s"]
        while not conn.poll(0):
            link.progress()
            if time.monotonic() > deadline:
                raise TimeoutError("no instruction from P")
            time.sleep(IDLE_SLEEP_S)
        message = conn.recv()
        if message[0] == "stop":
            break
        _, notif, seed, dst_ids, tokens = message
        bits.fill_(POISON)
        synchronize(device)
        link.send("ready")
        notified_ns = wait_for_notification(link, notif.encode())
        dst = torch.as_tensor(dst_ids, dtype=torch.int64, device=device)
        verdict = verify_blocks(bits, dst, seeded_bits(seed, geometry, len(dst_ids), device), tokens)
        link.send("result", notified_ns, asdict(verdict), link.stray_notifications)
        link.stray_notifications = []
    del ipc_target
    agent.close()


def wait_for_notification(link: Link, notif: bytes) -> int:
    """Spins on the agent (no sleep: this is the timed path) until `notif` arrives; returns the monotonic ns."""
    deadline = time.monotonic() + link.timeout_s
    while True:
        for sender, messages in link.agent.notifications().items():
            if notif in messages:
                arrived_ns = time.monotonic_ns()
                link.stray_notifications += [(sender, m) for m in messages if m not in (notif, HELLO)]
                return arrived_ns
            link.stray_notifications += [(sender, m) for m in messages if m != HELLO]
        if time.monotonic() > deadline:
            raise TimeoutError(f"notification {notif!r} did not arrive within {link.timeout_s} s")


# ---- P: the producer, and the driver of the whole run -------------------------------------


@dataclass
class Sample:
    """One timed transfer, in milliseconds."""

    plan_ms: float
    post_ms: float
    done_ms: float  # from just before post_write until the WRITE reads DONE on P
    notif_ms: float  # from just before post_write until D holds the notification (one monotonic clock)


def block_ids(kind: str, blocks: int, num_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """P's and D's block ids for a request; block 0 is vLLM's null block and is never handed out."""
    if kind == "consecutive":
        ids = np.arange(1, blocks + 1, dtype=np.int64)
        return ids, ids.copy()
    return (rng.permutation(np.arange(1, num_blocks, dtype=np.int64))[:blocks],
            rng.permutation(np.arange(1, num_blocks, dtype=np.int64))[:blocks])


class Producer:
    """P's cache and agent, connected to D."""

    def __init__(self, conn, geometry: Geometry, device: torch.device, timeout_s: float):
        self.geometry, self.device, self.timeout_s = geometry, device, timeout_s
        self.cache = allocate_cache(geometry, device)
        self.bits = self.cache.view(torch.int16)
        self.planes = cache_planes(self.cache, geometry)
        self.agent = make_agent(f"{NOTIF_PREFIX}-p-{os.getpid()}", self.cache)
        self.link = link = Link(conn, self.agent, timeout_s)
        peer_name, peer_metadata, self.peer_planes = link.receive("hello")
        started = time.monotonic_ns()
        self.peer = self.agent.add_peer(peer_metadata)
        self.agent.warm_up(self.peer)
        link.receive("connected")
        self.connect_ms = (time.monotonic_ns() - started) / 1e6
        if self.peer != peer_name:
            raise RuntimeError(f"D's metadata names agent {self.peer!r}, D says it is {peer_name!r}")
        try:
            self.ipc_target, self.ipc_error = link.receive("ipc")
        except PeerFailed:
            raise
        except (RuntimeError, OSError) as exc:  # D's buffer could not be mapped here
            self.ipc_target, self.ipc_error = None, repr(exc)
        self.transfers = 0

    def plan(self, path: str, src_ids: np.ndarray, dst_ids: np.ndarray, tokens: int) -> Plan:
        g = self.geometry
        src = Side(self.planes, g.element, g.head_size, g.block_size, 0, src_ids, 0, g.heads)
        dst = Side(self.peer_planes, g.element, g.head_size, g.block_size, 0, dst_ids, 0, g.heads)
        plan = build_plan(src, dst, (0, tokens), (0, g.heads))
        if path == "unmerged":
            plan = unmerged_plan(plan.src, plan.dst, plan.lengths, g.row_run_bytes)
        return plan

    def transfer(self, path: str, src_ids: np.ndarray, dst_ids: np.ndarray, tokens: int, seed: int) -> tuple[Sample, Plan, dict]:
        """One verified WRITE: fill, build the plan, post, poll to DONE, and collect D's timing and verdict."""
        self.transfers += 1
        notif = f"{NOTIF_PREFIX}|{self.transfers}"
        self.link.send("expect", notif, seed, dst_ids.tolist(), self.geometry.moved_tokens(tokens))
        src = torch.as_tensor(src_ids, dtype=torch.int64, device=self.device)
        self.bits.index_copy_(1, src, seeded_bits(seed, self.geometry, len(src_ids), self.device))
        synchronize(self.device)  # the WRITE must read what the fill wrote, as the connector waits on the forward
        self.link.receive("ready")
        t0 = time.monotonic_ns()
        plan = self.plan(path, src_ids, dst_ids, tokens)
        t1 = time.monotonic_ns()
        device = self.device.index or 0  # P and D share one GPU here
        write = self.agent.post_write(self.peer, plan.src, plan.dst, plan.lengths, device, device, notif.encode())
        t2 = time.monotonic_ns()
        deadline = time.monotonic() + self.timeout_s
        while (state := self.agent.poll(write)) == "PROC":  # spin: this is the timed path
            if time.monotonic() > deadline:
                raise TimeoutError(f"WRITE {notif} still in flight after {self.timeout_s} s")
        t3 = time.monotonic_ns()
        self.agent.release(write)
        if state != "DONE":
            raise RuntimeError(f"WRITE {notif} ended in state {state}")
        notified_ns, verdict, strays = self.link.receive("result")
        if strays:
            raise RuntimeError(f"D got notifications it did not expect: {strays}")
        sample = Sample((t1 - t0) / 1e6, (t2 - t1) / 1e6, (t3 - t1) / 1e6, (notified_ns - t1) / 1e6)
        return sample, plan, verdict

    def close(self) -> None:
        self.ipc_target = None
        self.link.send("stop")
        self.agent.close()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6) if ms > 0 else math.nan


def time_copies(device: torch.device, sizes: list[int], ipc_target: torch.Tensor | None, reps: int, warmup: int) -> list[dict]:
    """Median time of one torch copy_ of each size, within P and into D's memory through CUDA IPC."""
    largest = max(sizes)
    source = torch.randint(0, 256, (largest,), dtype=torch.uint8, device=device)
    targets = {"torch copy_": torch.empty_like(source)}
    if ipc_target is not None:
        targets["torch copy_ via CUDA IPC"] = ipc_target
    rows = []
    for nbytes in sizes:
        for kind, target in targets.items():
            src, dst = source[:nbytes], target[:nbytes]
            dst.zero_()
            for _ in range(warmup):
                dst.copy_(src)
            times_ms = []
            for _ in range(reps):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dst.copy_(src)
                    end.record()
                    end.synchronize()
                    times_ms.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter_ns()
                    dst.copy_(src)
                    times_ms.append((time.perf_counter_ns() - t0) / 1e6)
            ms = median(times_ms)
            rows.append({"bytes": nbytes, "kind": kind, "samples_ms": times_ms, "median_ms": ms, "gbps": gbps(nbytes, ms),
                         "verified": bool(torch.equal(dst, src))})
    return rows


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "cuda_runtime": torch.version.cuda, "host_cpus": os.cpu_count()}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12", "protobuf"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                               capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def measure_cell(producer: Producer, path: str, kind: str, tokens: int, ids: tuple[np.ndarray, np.ndarray], args) -> dict:
    """Warm-up plus timed transfers of one (prompt length, block ids, path); every one verified by D."""
    blocks = len(ids[0])
    cell = {"tokens": tokens, "ids": kind, "path": path, "blocks": blocks, "warmup": [], "samples": [], "failures": []}
    for i in range(args.warmup + args.iters):
        seed = args.seed * 1_000_003 + producer.transfers
        sample, plan, verdict = producer.transfer(path, ids[0], ids[1], tokens, seed)
        cell["warmup" if i < args.warmup else "samples"].append(asdict(sample))
        if not Verdict(**verdict).ok:
            cell["failures"].append(verdict)
    cell.update(bytes=plan.total_bytes, descriptors=len(plan), elementary_chunks=plan.unmerged_count,
                expected_bytes=producer.geometry.transfer_bytes(tokens))
    cell["verified"] = not cell["failures"] and cell["bytes"] == cell["expected_bytes"]
    for field in ("plan_ms", "post_ms", "done_ms", "notif_ms"):
        cell[f"median_{field}"] = median([s[field] for s in cell["samples"]])
    cell["gbps_done"] = gbps(cell["bytes"], cell["median_done_ms"])
    cell["gbps_notif"] = gbps(cell["bytes"], cell["median_notif_ms"])
    cell["gbps_with_plan"] = gbps(cell["bytes"], median([s["plan_ms"] + s["notif_ms"] for s in cell["samples"]]))
    print(f"  {tokens:>6} tokens {kind:<11} {path:<8} {len(plan):>7} descriptors {cell['median_notif_ms']:9.3f} ms  "
          f"{'ok' if cell['verified'] else 'WRONG BYTES'}", flush=True)
    return cell


def run(args: argparse.Namespace, save) -> dict:
    """The whole benchmark; `save(result)` is called after every step, so a failure keeps what was measured."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    block_counts = {t: -(-t // args.block_size) for t in tokens_list}
    num_blocks = args.num_blocks or 2 * max(block_counts.values()) + 1
    geometry = Geometry(args.layers, args.kv_heads, args.head_size, args.block_size, num_blocks, block_major=args.layout == "block-major")
    sizes = sorted({geometry.transfer_bytes(t) for t in tokens_list})
    rng = np.random.default_rng(args.seed)
    ids = {(t, kind): block_ids(kind, block_counts[t], num_blocks, rng) for t in tokens_list for kind in args.ids.split(",")}
    result = {"environment": environment(device), "device": str(device), "geometry": asdict(geometry), "args": vars(args),
              "connect_ms": None, "ipc_error": None, "copies": [], "transfers": [], "summary": [], "complete": False,
              "error": None}
    options = {"device": str(device), "geometry": asdict(geometry), "timeout_s": args.timeout,
               "ipc_bytes": max(sizes) if device.type == "cuda" and not args.no_ipc else 0}
    context = torch_mp.get_context("spawn")
    p_end, d_end = context.Pipe()
    consumer = context.Process(target=consumer_main, args=(d_end, options), daemon=True)
    consumer.start()
    try:
        producer = Producer(p_end, geometry, device, args.timeout)
        result.update(connect_ms=producer.connect_ms, ipc_error=producer.ipc_error)
        result["copies"] = time_copies(device, sizes, producer.ipc_target, args.copy_reps, args.copy_warmup)
        save(result)
        # The merged path first for every size: if the many-descriptor path breaks, kvpush's own numbers are in.
        for path in args.paths.split(","):
            for (tokens, kind), cell_ids in ids.items():
                result["transfers"].append(measure_cell(producer, path, kind, tokens, cell_ids, args))
                result["summary"] = summarize(result["transfers"], result["copies"])
                save(result)
        producer.close()
        consumer.join(timeout=args.timeout)
        result["complete"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        if consumer.is_alive():  # D failed, or P failed and D still waits for it
            consumer.terminate()
            consumer.join(timeout=10)
    save(result)
    return result


def summarize(transfers: list[dict], copies: list[dict]) -> list[dict]:
    """Each cell's bandwidth (post to D's notification) as a fraction of the same-process copy of the same bytes."""
    copy_gbps = {c["bytes"]: c["gbps"] for c in copies if c["kind"] == "torch copy_"}
    rows = []
    for cell in transfers:
        fraction = cell["gbps_notif"] / copy_gbps.get(cell["bytes"], math.nan)
        rows.append({"tokens": cell["tokens"], "ids": cell["ids"], "path": cell["path"], "fraction_of_copy": fraction,
                     "meets_target": bool(fraction >= TARGET_FRACTION_OF_COPY)})
    return rows


def format_table(result: dict) -> str:
    """Rows by prompt length, block ids and path, each size followed by its copies."""
    copies = {(c["bytes"], c["kind"]): c for c in result["copies"]}
    fractions = {(s["tokens"], s["ids"], s["path"]): s["fraction_of_copy"] for s in result["summary"]}
    header = (f"{'tokens':>6} {'block ids':<11} {'path':<24} {'bytes':>10} {'descs':>7} {'plan ms':>8} {'post ms':>8} "
              f"{'->DONE ms':>9} {'->notif ms':>10} {'GB/s':>8} {'% copy':>7} ok")
    lines = [header, "-" * len(header)]
    order = {name: i for i, name in enumerate(ID_KINDS + PATHS)}
    cells = sorted(result["transfers"], key=lambda c: (c["tokens"], order[c["ids"]], order[c["path"]]))
    for tokens in dict.fromkeys(c["tokens"] for c in cells):
        rows = [c for c in cells if c["tokens"] == tokens]
        for c in rows:
            pct = 100 * fractions[(c["tokens"], c["ids"], c["path"])]
            lines.append(f"{tokens:>6} {c['ids']:<11} {c['path']:<24} {c['bytes']:>10} {c['descriptors']:>7} "
                         f"{c['median_plan_ms']:8.2f} {c['median_post_ms']:8.2f} {c['median_done_ms']:9.3f} "
                         f"{c['median_notif_ms']:10.3f} {c['gbps_notif']:8.2f} {pct:6.1f}% {'yes' if c['verified'] else 'NO'}")
        for (size, kind), c in copies.items():
            if size == rows[0]["bytes"]:
                pct = 100 * c["gbps"] / copies[(size, "torch copy_")]["gbps"]
                lines.append(f"{tokens:>6} {'-':<11} {kind:<24} {size:>10} {'-':>7} {'-':>8} {'-':>8} {c['median_ms']:9.3f} "
                             f"{'-':>10} {c['gbps']:8.2f} {pct:6.1f}% {'yes' if c['verified'] else 'NO'}")
    lines.append("GB/s = bytes / median(post start -> notification on D), plan excluded; copies: bytes / median copy time "
                 f"({'CUDA events' if result['device'].startswith('cuda') else 'host clock'}). "
                 f"'% copy' against the same-process torch copy_ of the same bytes. Target: merged >= {TARGET_FRACTION_OF_COPY:.0%}.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=1, help="local KV heads per rank (Qwen3-32B at TP8: 1)")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layout", choices=("layer-major", "block-major"), default="layer-major",
                        help="KV cache allocation: each layer's blocks together (vLLM's default) or each block's layers together")
    parser.add_argument("--num-blocks", type=int, default=0, help="blocks in each pool; default twice the largest request, plus block 0")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--ids", default=",".join(ID_KINDS))
    parser.add_argument("--iters", type=int, default=5, help="timed transfers per cell")
    parser.add_argument("--warmup", type=int, default=1, help="untimed transfers per cell, before the timed ones")
    parser.add_argument("--copy-reps", type=int, default=20)
    parser.add_argument("--copy-warmup", type=int, default=3)
    parser.add_argument("--no-ipc", action="store_true", help="skip the copy into D's memory through CUDA IPC")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--out", required=True, help="JSON file for every sample")
    args = parser.parse_args(argv)
    for name in ("paths", "ids"):
        allowed = PATHS if name == "paths" else ID_KINDS
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}; choose from {allowed}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all verified, 1 some bytes were wrong, 2 the run broke off (what was measured is in --out)."""
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(result: dict) -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result = run(args, save)
    print(json.dumps(result["environment"]))
    if result["connect_ms"] is not None:
        print(f"connection setup (add_peer + hello seen by D): {result['connect_ms']:.1f} ms")
    if result["ipc_error"]:
        print(f"no copy through CUDA IPC: {result['ipc_error']}")
    print(format_table(result))
    if result["error"]:
        print(f"run broke off:\n{result['error']}", file=sys.stderr)
        return 2
    wrong = [c for c in result["transfers"] if not c["verified"]] + [c for c in result["copies"] if not c["verified"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
