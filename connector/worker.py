# SPDX-License-Identifier: Apache-2.0
"""The worker side of the connector: one per TP/PP rank of an engine.

At startup it registers the KV cache with NIXL and its rank with the
registrar. During serving, the engine thread only hands work to the transfer
thread (producer or consumer) and collects results; when a step has nothing
to compute it sleeps until a transfer makes progress instead of spinning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from typing import Any

import torch

from kvpush.clock import SystemClock
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.consumer import Consumer, ConsumerCore
from kvpush.connector.control import ControlSession
from kvpush.connector.forward_times import ForwardTimes
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout, mamba2_state_tensors, sliding_window_of
from kvpush.connector.metadata import KvpushHandshake, KvpushMetadata
from kvpush.connector.nixl_agent import KvAgent, MemoryRange
from kvpush.connector.producer import ProducerCore
from kvpush.connector.producer_thread import Producer
from kvpush.connector.report_routing import ReportRouter
from kvpush.connector.report_stream import Report
from kvpush.connector.segment_stats import KvReceivedTimes
from kvpush.connector.spans import Spans
from kvpush.connector.write_plans import LocalLayout
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import states
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb

logger = logging.getLogger(__name__)

TRANSFER_FORMAT = "kvpush1"
# nixl_progress_thread_ms "auto" for a KV cache in host memory, by role. UCX's events wake the thread whatever its delay,
# so the delay sets how often an idle engine pays for a wake-up (~15-20 us each here): a prefill engine's WRITEs complete
# on those events alone, while a decode engine's notifications arrived later with 100 ms (bench/results/LOG.md).
AUTO_PROGRESS_THREAD_MS = {"prefill": 100, "decode": 5}
AUTO_WAITING_POLL_MS = 5  # waiting_poll_ms "auto" for a KV cache in host memory
# The KV cache specs kvpush moves (vLLM's class names; MLAAttentionSpec subclasses FullAttentionSpec, so by exact name).
GROUP_KINDS = {"FullAttentionSpec": engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION, "MLAAttentionSpec": engine_pb2.KV_CACHE_GROUP_KIND_MLA,
               "SlidingWindowSpec": engine_pb2.KV_CACHE_GROUP_KIND_SLIDING_WINDOW, "MambaSpec": engine_pb2.KV_CACHE_GROUP_KIND_STATE}


def incarnation_of(vllm_config: Any, engine_id: str) -> str:
    """Same in the scheduler and every worker of one engine start, new at every start."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"kvpush:{engine_id}:{vllm_config.instance_id}").hex


def compatibility_hash(vllm_config: Any, layout: engine_pb2.KvLayout) -> str:
    """What P and D must agree on for KV bytes to mean the same thing (block size and TP may differ)."""
    model = vllm_config.model_config
    parts = [
        TRANSFER_FORMAT,
        ",".join(getattr(model.hf_config, "architectures", None) or []),
        str(layout.dtype),
        str(layout.head_size),
        str(layout.total_kv_heads),
        str(layout.num_layers),
        str(getattr(model.hf_config, "vocab_size", "")),
        *(g.state_format for g in layout.groups if g.state_format),
        *(states.signature(g) for g in layout.groups if states.splittable(g)),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def state_format_of(spec: Any) -> str:
    """A Mamba group's state layout in words: its states' dtypes and vLLM's conv-state layout (SD or DS).

    Not their shapes: those are a TP rank's share, and engines of other TP
    sizes must get the broker's own refusal, not a hash mismatch.
    """
    names = ("conv", "ssm") if len(spec.shapes) == 2 else tuple(f"state{i}" for i in range(len(spec.shapes)))
    states = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, dtype in zip(names, spec.dtypes))
    return f"{states}, conv layout {os.environ.get('VLLM_SSM_CONV_STATE_LAYOUT', 'default')}"


def _conv_state_dim_first() -> bool:
    """Whether vLLM stores Mamba conv states channel-major ((dim, state_len), its "DS" layout)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()


def _parallel_ranks() -> tuple[int, int, int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size


class KvpushWorker:
    """Worker-side state and the per-step hand-offs."""

    def __init__(self, config: ConnectorConfig, vllm_config: Any, kv_cache_config: Any):
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.incarnation = incarnation_of(vllm_config, config.engine_id)
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = _parallel_ranks()
        if self.pp_size > 1 and config.role == "decode":
            raise ValueError(f"kvpush: --pipeline-parallel-size {self.pp_size} is not supported on a decode engine: kvpush writes "
                             "into decode engines of pipeline-parallel size 1 (a prefill engine may be pipeline-parallel)")
        # One rank speaks for the engine (prefill-done, cancels, its spans): the first stage's, whose forward ends first,
        # so the broker's orders reach the later stages while they still compute.
        self.speaks_for_engine = self.tp_rank == 0 and self.pp_rank == 0
        self.spans = Spans(config.engine_id, config.role)
        self.agent: KvAgent | None = None
        self.session: ControlSession | None = None
        self.reports: ReportRouter | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.memory_is_device = False
        self.progressive = False  # layer-progressive push (config.progressive_push, resolved at registration)
        self._layer_index: dict[str, int] = {}
        self._forward_meta: KvpushMetadata | None = None  # the step whose forward is running (layer-progressive push)
        self._computing: tuple[tuple[str, int], ...] = ()  # its completing sources' keys
        self.forward_times = ForwardTimes()  # P: when the running forward should end (decode ranks are told ahead)

    # ---- startup --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout, ranges, device = self._describe(kv_caches)
        self.memory_is_device = layout.memory_kind == engine_pb2.MEMORY_KIND_VRAM
        self.progressive = self.config.progressive_push == "on" or (self.config.progressive_push == "auto" and self.memory_is_device)
        self._layer_index = {r.layer_name: r.layer_index for r in layout.regions}
        name = f"{self.config.engine_id}.{self.incarnation[:12]}.tp{self.tp_rank}.pp{self.pp_rank}"
        progress_thread_ms = self.config.nixl_progress_thread_ms
        if progress_thread_ms is None:  # "auto": it saves ~1.5 ms per WRITE between host memories, nothing on GPUs
            progress_thread_ms = 0 if self.memory_is_device else AUTO_PROGRESS_THREAD_MS[self.config.role]
        self.agent = KvAgent(name, list(self.config.backends), "VRAM" if self.memory_is_device else "DRAM", progress_thread_ms)
        self.agent.register(ranges)
        request = reg_pb.RegisterEngineRankRequest(
            rank=engine_pb2.EngineRank(
                engine_id=self.config.engine_id,
                incarnation=self.incarnation,
                role=engine_pb2.ENGINE_ROLE_PREFILL if self.config.role == "prefill" else engine_pb2.ENGINE_ROLE_DECODE,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                pp_rank=self.pp_rank,
                pp_size=self.pp_size,
            ),
            nixl=engine_pb2.NixlAgent(agent_name=name, agent_metadata=self.agent.metadata(), backends=list(self.config.backends)),
            layout=layout,
            compatibility_hash=compatibility_hash(self.vllm_config, layout),
        )
        request.lease_ttl.FromNanoseconds(int(self.config.lease_ttl_s * 1e9))
        self.session = session = ControlSession(self.config, f"kvpush-control-tp{self.tp_rank}.pp{self.pp_rank}")
        lease = session.register_rank(request)
        session.keep_alive(request, lease)
        poll_s, idle_s = self.config.poll_interval_ms / 1000, self.config.idle_poll_ms / 1000
        clock = SystemClock()
        if self.config.role == "prefill":
            self.reports = session.report_stream(self.config.engine_id)
            local = LocalLayout(layout, self.tp_rank, self.tp_size, device, self.pp_rank, self.pp_size)
            producer_core = ProducerCore(self.agent, local, self.config.engine_id, self._report_write_result, self.spans, clock,
                                prefill_done=self._report_prefill_done if self.speaks_for_engine else None)
            self.producer = Producer(producer_core, poll_s, idle_s)
            watch = reg_pb.WatchEnginesRequest(role=engine_pb2.ENGINE_ROLE_DECODE)
            session.follow("WatchEngines", lambda: session.registrar.watch_engines(watch), self.producer.on_engine_event)
            orders = rv_pb.StreamWriteOrdersRequest(
                engine_id=self.config.engine_id, incarnation=self.incarnation, tp_rank=self.tp_rank,
                pp_rank=self.pp_rank, early_orders=self.config.early_orders,
            )
            # One stream per broker member, each its own generation: orders are only acted on while their stream lives.
            session.follow_members("StreamWriteOrders", lambda broker: broker.stream_write_orders(orders),
                                        self.producer.open_stream, self.producer.stream_lost)
        else:
            waiting_ms = self.config.waiting_poll_ms
            if waiting_ms is None:  # "auto"
                waiting_ms = 0 if self.memory_is_device else AUTO_WAITING_POLL_MS
            consumer_core = ConsumerCore(self.agent, self.spans, clock, waiting_poll_s=waiting_ms / 1000 if waiting_ms else None,
                                fresh_poll_s=self.config.fresh_poll_ms / 1000)
            self.consumer = Consumer(consumer_core, poll_s, idle_s)
        logger.info("kvpush: %s rank tp%d pp%d registered (%s, %d regions, agent %s)", self.config.role, self.tp_rank, self.pp_rank,
                    layout.memory_kind and engine_pb2.MemoryKind.Name(layout.memory_kind), len(layout.regions), name)

    def _describe(self, kv_caches: dict[str, torch.Tensor]) -> tuple[engine_pb2.KvLayout, list[MemoryRange], int]:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.model_executor.models.utils import extract_layer_index

        layers, groups, kinds = [], [], set()
        for group_index, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            kind = GROUP_KINDS.get(type(spec).__name__)
            if kind is None:
                raise ValueError(f"kvpush: KV cache group {group_index} is {type(spec).__name__}; kvpush moves "
                                 f"{', '.join(GROUP_KINDS)} groups")
            state = kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE
            groups.append(GroupSpec(spec.block_size, self.kv_cache_config.num_blocks, kind, sliding_window_of(spec),
                                    state_format_of(spec) if state else "",
                                    mamba2_state_tensors(spec, self.vllm_config.model_config.hf_config, self.tp_size,
                                                         _conv_state_dim_first()) if state else ()))
            kinds.add(kind)
            layers += [LayerTensor(extract_layer_index(n), n, group_index, kv_caches[n]) for n in group.layer_names]
        if engine_pb2.KV_CACHE_GROUP_KIND_MLA in kinds and len(kinds) != 1:
            raise ValueError("kvpush: a model mixing MLA and other KV cache groups is not supported")
        attention = [g for g, spec in zip(self.kv_cache_config.kv_cache_groups, groups) if spec.kind != engine_pb2.KV_CACHE_GROUP_KIND_STATE]
        if not attention:
            raise ValueError("kvpush: a model without attention layers is not supported")
        if len(attention) < len(groups) and self.vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("kvpush: prefix caching with state-space (Mamba) layers is not supported: start the engine with "
                             "--no-enable-prefix-caching")
        backends = {b.get_name() for b in get_current_attn_backends(self.vllm_config, [n for g in attention for n in g.layer_names])}
        if len(backends) != 1:
            raise ValueError(f"kvpush: one attention backend expected, found {sorted(backends)}")
        spec = attention[0].kv_cache_spec
        # An MLA latent is one head, the same on every TP rank: every rank holds "head 0" of 1.
        mla = kinds == {engine_pb2.KV_CACHE_GROUP_KIND_MLA}
        total_kv_heads = 1 if mla else self.vllm_config.model_config.get_total_num_kv_heads()
        # The model's layers (a pipeline stage holds some, a state-space hybrid's MLPs none), so that every stage and D agree.
        num_layers = self.vllm_config.model_config.get_total_num_hidden_layers()
        return build_layout(backends.pop(), layers, groups, dtype=str(spec.dtype), head_size=spec.head_size,
                            total_kv_heads=total_kv_heads, num_local_heads=1 if mla else spec.num_kv_heads,
                            num_layers=num_layers, tp_rank=self.tp_rank, tp_size=self.tp_size)

    def handshake(self) -> KvpushHandshake:
        return KvpushHandshake(incarnation=self.incarnation)

    # ---- per step -------------------------------------------------------------------

    def forward_starts(self, meta: KvpushMetadata) -> None:
        """The step's metadata is bound: its forward runs next (vLLM calls start_load_kv only after launching it).

        The transfer thread makes the WRITEs of the step's completing prefills
        meanwhile, so the forward's end (wait_for_save) only has them posted,
        and tells their decode ranks due_notice_ms before the forward's
        predicted end that the WRITEs are due.
        """
        if self.producer is not None and not self.progressive:
            ends_at = self.forward_times.started(time.monotonic(), meta.scheduled_tokens)
            announce_at = ends_at - self.config.due_notice_ms / 1000 if ends_at is not None else None
            for source in meta.sources:
                self.producer.computing(source, whole=True, announce_at=announce_at)

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        if self.consumer is not None:
            for recv in meta.recvs:
                self.consumer.expect(recv)
            for req_id, reason in meta.fails.items():
                self.consumer.fail(req_id, reason)
        if meta.cancels and self.speaks_for_engine:
            cancels = []
            for transfer_id, attempt in meta.cancels:
                request = rv_pb.CancelTransferRequest(detail="prefill request aborted")
                request.key.transfer_id, request.key.attempt = transfer_id, attempt
                cancels.append(Report("cancels", request))
            self._report_router.send_many(cancels)

    def save_kv_layer(self, layer_name: str, meta: KvpushMetadata) -> None:
        """Layer-progressive push: the layer's KV of this step's completing prefills may leave now (on the transfer thread).

        The step's first layer hands the sources over: vLLM may call
        start_load_kv only after launching the forward.
        """
        if self.producer is None or not self.progressive or not meta.sources:
            return
        if meta is not self._forward_meta:
            self._forward_meta = meta
            for source in meta.sources:
                self.producer.computing(source)
            self._computing = tuple((s.transfer_id, s.attempt) for s in meta.sources)
        event = None
        if self.memory_is_device:
            event = torch.cuda.Event()
            event.record()
        self.producer.layer_done(self._computing, self._layer_index[layer_name], event)

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        self._forward_meta, self._computing = None, ()
        self.forward_times.ended(time.monotonic())
        if self.producer is None or not meta.sources:
            return
        ready_event = None
        if self.memory_is_device:
            ready_event = torch.cuda.Event()
            ready_event.record()
        now_ns = time.time_ns()
        for source in meta.sources:
            self.producer.source_ready(source, ready_event, now_ns)
            if self.tp_rank == 0 and self.pp_rank == self.pp_size - 1:  # the last stage ends the prefill
                self.spans.emit("p.queue", source.arrival_ns, source.scheduled_ns, source)
                self.spans.emit("p.prefill", source.scheduled_ns, now_ns, source, tokens=source.num_tokens)
                self.spans.segments.segment("p_queue", source.arrival_ns, source.scheduled_ns)
                self.spans.segments.segment("p_prefill", source.scheduled_ns, now_ns)
        # The WRITE is on the critical path, this step's sampling is not: let the transfer thread (woken
        # by the hand-over) take the GIL now rather than when this thread next blocks or is forced to switch.
        os.sched_yield()

    @property
    def _report_router(self) -> ReportRouter:
        """A prefill rank's reports to the broker (its stream is opened at registration)."""
        if self.reports is None:
            raise RuntimeError("kvpush: only a registered prefill rank sends reports to the broker")
        return self.reports

    def _report_write_result(self, request: rv_pb.ReportWriteResultRequest) -> None:
        """On the transfer thread: to the broker member whose order it answers (it holds the attempt, owner or not)."""
        assert self.producer is not None, "only the producer's transfer thread reports write results"
        to = self.producer.core.answer_member((request.key.transfer_id, request.key.attempt))
        self._report_router.send(Report("write_results", request, to=to))

    def _report_prefill_done(self, source: SourceReady) -> None:
        """On the transfer thread, after any WRITE its early order allowed was posted."""
        request = rv_pb.ReportPrefillDoneRequest(client_request_id=source.client_request_id, decode_engine_id=source.decode_engine_id)
        request.key.transfer_id, request.key.attempt = source.transfer_id, source.attempt
        request.source.engine_id, request.source.incarnation, request.source.num_tokens = self.config.engine_id, self.incarnation, source.num_tokens
        for group, ids in enumerate(source.blocks):
            request.source.blocks.add(group_index=group, block_ids=ids)
        request.timeout.FromMilliseconds(int(source.hold_s * 1000))
        if source.traceparent:
            request.trace_context["traceparent"] = source.traceparent
        spans = self.spans

        def answered(answer, error) -> None:
            spans.emit("p.prefill_done_report", report.sent_ns, time.time_ns(), source)
            if error is not None:
                logger.warning("kvpush: prefill-done of %s/%s failed: %s", source.transfer_id, source.attempt, error)

        report = Report("prefill_done", request, answered)
        self._report_router.send(report)

    def get_transfer_results(self, meta: KvpushMetadata | None) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving)."""
        idle = meta is not None and meta.idle
        wait_s = self.config.idle_wait_ms / 1000
        if self.producer is not None:
            done = self.producer.take_finished()
            if not done and idle and self.producer.has_work() and self.producer.ready.wait(wait_s):
                done = self.producer.take_finished()
            return done, set(), set()
        if self.consumer is not None:
            # The KV that landed during this step is taken now: vLLM acts on it only from here (consumer.py).
            finished, failed = self.consumer.poll() if self.consumer.has_work() else self.consumer.take_results()
            if not finished and idle and self.consumer.has_work():
                finished, failed = self.consumer.wait(wait_s)
            return set(), finished, failed
        return set(), set(), set()

    def received_times(self) -> KvReceivedTimes | None:
        """D: when this rank's receives published since the last step got their KV, for the scheduler's d_wait_tail."""
        received = self.consumer.core.take_received_times() if self.consumer is not None else None
        return KvReceivedTimes(received) if received else None

    def shutdown(self) -> None:
        for part in (self.producer, self.consumer):
            if part is not None:
                part.stop()
        if self.session is not None:
            self.session.close()
        if self.agent is not None:
            self.agent.close()
        self.spans.close()
