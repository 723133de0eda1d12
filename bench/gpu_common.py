# SPDX-License-Identifier: Apache-2.0
"""What the data-path benchmarks share: a KV cache laid out as vLLM's FLASH_ATTN backend hands it
over, a producer P (the benchmark's own process) and a consumer D (a spawned child) with real NIXL
agents, D's poisoning and byte-for-byte verification, and the pipe between them.

D's loop: for each "expect" it optionally poisons its whole cache (`fill`), acknowledges "ready",
spins on NIXL notifications until every expected one arrived (none: it only acknowledges), and
optionally verifies the transferred tokens and every other byte of its cache (`verify`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from kvpush.connector.nixl_agent import HELLO, KvAgent, MemoryRange
from kvpush.layout.geometry import Plane, describe_layer
from kvpush.layout.pages import PageTable, page_table, pages_match
from kvpush.layout.plan import Side

POISON = -1  # int16 bits D fills its cache with before a transfer (a bf16 NaN)
NOTIF_PREFIX = "kvpush-bench"
IDLE_SLEEP_S = 50e-6  # between checks while waiting for the other process (not while timing)


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

    def transfer_bytes(self, tokens: int, layers: int | None = None) -> int:
        """Keys and values of the moved tokens of every (or `layers`) layer(s) and local head."""
        return (layers or self.layers) * self.moved_tokens(tokens) * self.heads * 2 * self.head_size * self.element

    def side(self, planes: list[Plane], ids: np.ndarray) -> Side:
        return Side(planes, self.element, self.head_size, self.block_size, 0, ids, 0, self.heads)

    def pages(self, planes: list[Plane]) -> PageTable:
        table = page_table(self.side(planes, np.zeros(0, dtype=np.int64)), self.num_blocks)
        if table is None:
            raise RuntimeError("the cache's planes do not tile whole pages")
        return table


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


def make_agent(name: str, cache: torch.Tensor, progress_thread_ms: int) -> KvAgent:
    agent = KvAgent(name, ["UCX"], "VRAM" if cache.is_cuda else "DRAM", progress_thread_ms)
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
    """D: registers its cache, then serves "expect" messages until "stop"."""
    try:
        run_consumer(conn, options)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def run_consumer(conn, options: dict) -> None:
    device = torch.device(options["d_device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # two processes share the cores; the producer's copies are single-threaded too
    else:
        torch.cuda.set_device(device)
    geometry = Geometry(**options["geometry"])
    cache = allocate_cache(geometry, device)
    bits = cache.view(torch.int16)
    agent = make_agent(f"{NOTIF_PREFIX}-d-{os.getpid()}", cache, options["progress_thread_ms"])
    link = Link(conn, agent, options["timeout_s"])
    link.send("hello", agent.name, agent.metadata(), cache_planes(cache, geometry), device.index or 0)
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
        _, notifs, seed, dst_ids, tokens, fill, verify = message
        if fill:
            bits.fill_(POISON)
            synchronize(device)
        link.send("ready")
        arrived = wait_for_notifications(link, [n.encode() for n in notifs])
        verdict = None
        if verify:
            dst = torch.as_tensor(dst_ids, dtype=torch.int64, device=device)
            verdict = asdict(verify_blocks(bits, dst, seeded_bits(seed, geometry, len(dst_ids), device), tokens))
        link.send("result", arrived, verdict, link.stray_notifications)
        link.stray_notifications = []
    del ipc_target
    agent.close()


def wait_for_notifications(link: Link, wanted: list[bytes]) -> list[int]:
    """Spins on the agent (no sleep: this is the timed path) until every wanted notification arrived; their monotonic ns."""
    arrived: dict[bytes, int] = {}
    deadline = time.monotonic() + link.timeout_s
    while len(arrived) < len(wanted):
        for sender, messages in link.agent.notifications().items():
            now = time.monotonic_ns()
            for m in messages:
                if m in wanted and m not in arrived:
                    arrived[m] = now
                elif m != HELLO:
                    link.stray_notifications.append((sender, m))
        if time.monotonic() > deadline:
            raise TimeoutError(f"notifications {[w for w in wanted if w not in arrived]} did not arrive within {link.timeout_s} s")
    return [arrived[w] for w in wanted]


# ---- P's side of the connection --------------------------------------------------------


class ProducerSide:
    """P's cache and agent, connected to D, with both sides' page tables prepared (kvpush's per-peer lists)."""

    def __init__(self, conn, geometry: Geometry, device: torch.device, timeout_s: float, progress_thread_ms: int = 0):
        self.geometry, self.device, self.timeout_s = geometry, device, timeout_s
        self.cache = allocate_cache(geometry, device)
        self.bits = self.cache.view(torch.int16)
        self.planes = cache_planes(self.cache, geometry)
        self.agent = make_agent(f"{NOTIF_PREFIX}-p-{os.getpid()}", self.cache, progress_thread_ms)
        self.link = link = Link(conn, self.agent, timeout_s)
        peer_name, peer_metadata, self.peer_planes, self.peer_device = link.receive("hello")
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
        self.device_index = device.index or 0
        self.local_pages, self.peer_pages = geometry.pages(self.planes), geometry.pages(self.peer_planes)
        empty = np.zeros(0, dtype=np.int64)
        if not pages_match(geometry.side(self.planes, empty), geometry.side(self.peer_planes, empty), self.local_pages, self.peer_pages,
                           (0, geometry.heads)):
            raise RuntimeError("P's and D's pages differ: page WRITEs cannot carry this geometry")
        started = time.monotonic_ns()
        self.local_prepared = self.agent.prepare_pages(None, self.local_pages.rows(self.device_index))
        self.peer_prepared = self.agent.prepare_pages(self.peer, self.peer_pages.rows(self.peer_device))
        self.prepare_ms = (time.monotonic_ns() - started) / 1e6
        self.transfers = 0

    def fill(self, seed: int, src_ids: np.ndarray) -> None:
        """P's source blocks get the seeded bits D will check; synchronized, as the connector waits on the forward."""
        src = torch.as_tensor(src_ids, dtype=torch.int64, device=self.device)
        self.bits.index_copy_(1, src, seeded_bits(seed, self.geometry, len(src_ids), self.device))
        synchronize(self.device)

    def close(self) -> None:
        self.ipc_target = None
        self.link.send("stop")
        self.agent.close()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def gpu_clocks() -> str:
    """SM and memory clocks now, and their maxima (nvidia-smi), to note with the figures."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=index,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"


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
        env["gpus"] = torch.cuda.device_count()
        env["clocks_at_start"] = gpu_clocks()
    return env


# ---- the command line both benchmarks share ----------------------------------------------


def add_common_options(parser: argparse.ArgumentParser, *, seed: int) -> None:
    """Device, geometry of one TP8 rank of Qwen3-32B, samples, timeout and output."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--d-device", type=int, default=0, help="D's CUDA device index (P is on 0)")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=1, help="local KV heads per rank (Qwen3-32B at TP8: 1)")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30, help="timed samples per cell")
    parser.add_argument("--warmup", type=int, default=3, help="untimed samples per cell, before the timed ones")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--nixl-progress-thread-ms", type=int, default=0,
                        help="both agents with NIXL's event-driven progress thread waking at least this often (0: none, as measured before)")
    parser.add_argument("--out", required=True, help="JSON file for every sample")


def check_common_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.device == "cpu" and args.d_device:
        parser.error("--d-device needs --device cuda")
    return args


def run_and_report(args: argparse.Namespace, run, lines) -> int:
    """Runs `run(args, save)` (save writes --out after every step), prints `lines(result)`; 0 verified, 1 wrong bytes, 2 broke off."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(result: dict) -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result = run(args, save)
    print(json.dumps(result["environment"]))
    print("\n".join(lines(result)))
    if result["error"]:
        print(f"run broke off:\n{result['error']}", file=sys.stderr)
        return 2
    return 0 if result["verified"] else 1


def devices(args: argparse.Namespace) -> tuple[torch.device, torch.device]:
    """P's and D's devices (P on GPU 0; on CPU one torch thread each: the two processes share the cores)."""
    if args.device == "cuda":
        return torch.device("cuda", 0), torch.device("cuda", args.d_device)
    torch.set_num_threads(1)
    return torch.device("cpu"), torch.device("cpu")


def run_session(args: argparse.Namespace, geometry: Geometry, result: dict, save: Callable[[dict], None],
                producer_side: Callable[[object], None], *, ipc_bytes: int = 0) -> dict:
    """Spawns D, runs `producer_side(conn)` as P (it closes its ProducerSide at the end), and stops D whatever happened.

    An exception is kept in result["error"] with what was measured before it.
    """
    _, d_device = devices(args)
    options = {"d_device": str(d_device), "geometry": asdict(geometry), "timeout_s": args.timeout, "ipc_bytes": ipc_bytes,
               "progress_thread_ms": args.nixl_progress_thread_ms}
    context = torch_mp.get_context("spawn")
    p_end, d_end = context.Pipe()
    consumer = context.Process(target=consumer_main, args=(d_end, options), daemon=True)
    consumer.start()
    try:
        producer_side(p_end)
        consumer.join(timeout=args.timeout)
        result["complete"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        if consumer.is_alive():  # D failed, or P failed and D still waits for it
            consumer.terminate()
            consumer.join(timeout=10)
    if args.device == "cuda":
        result["environment"]["clocks_at_end"] = gpu_clocks()
    return result
