# SPDX-License-Identifier: Apache-2.0
"""KvpushConnector: the vLLM KV connector facade.

vLLM builds one instance per role: SCHEDULER in EngineCore, WORKER in every
worker process. This class only routes vLLM's calls to the scheduler-side or
worker-side logic; neither does blocking network work on the engine thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KvpushHandshake, KvpushMetadata
from kvpush.connector.segment_recorder import empty_observations
from kvpush.connector.segment_stats import KvpushConnectorStats, KvpushPromMetrics, KvReceivedTimes
from kvpush.logs import show_kvpush_logs
from kvpush.telemetry import configure_tracing

if TYPE_CHECKING:
    import torch

    from kvpush.connector.scheduler import DecodeScheduler, PrefillScheduler
    from kvpush.connector.worker import KvpushWorker

logger = logging.getLogger(__name__)


class KvpushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-mode KV transfer over NIXL WRITE with a gRPC control plane."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_kv_transfer_config(vllm_config.kv_transfer_config)
        show_kvpush_logs(self.config.log_level)
        configure_tracing(f"kvpush-{self.config.role}")
        self._scheduler: DecodeScheduler | PrefillScheduler | None = None
        self._worker: KvpushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvpush.connector.scheduler import make_scheduler

            self._scheduler = make_scheduler(self.config, vllm_config, kv_cache_config)
        else:
            from kvpush.connector.worker import KvpushWorker

            self._worker = KvpushWorker(self.config, vllm_config, kv_cache_config)

    # vLLM calls each role's methods only on that role's instance.
    @property
    def scheduler_side(self) -> DecodeScheduler | PrefillScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-role connector")
        return self._scheduler

    @property
    def worker_side(self) -> KvpushWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler-role connector")
        return self._worker

    # ---- scheduler side -------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvpushMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_push_work()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KvpushHandshake]) -> None:
        self.scheduler_side.on_handshake(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KvpushHandshake]) -> None:
        self.scheduler_side.on_handshake({(0, rank): m for rank, m in metadata.items()})

    # ---- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KvpushHandshake | None:
        return self.worker_side.handshake()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvpushMetadata):
            self._worker.forward_starts(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # KV arrives whole, before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker_side.save_kv_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata if isinstance(self._connector_metadata, KvpushMetadata) else None
        sending, recving, failed = self.worker_side.get_transfer_results(meta)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    # ---- metrics (both roles) ---------------------------------------------------------

    def get_kv_connector_stats(self) -> KvpushConnectorStats | None:
        data = (self._scheduler or self.worker_side).spans.segments.drain()
        return None if data is None else KvpushConnectorStats(data=data)

    def build_connector_worker_meta(self) -> KvReceivedTimes | None:
        return self.worker_side.received_times()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvpushConnectorStats:
        return KvpushConnectorStats(data={**empty_observations(), **data}) if data is not None else KvpushConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvpushPromMetrics:
        # Built in vLLM's API server, which reads the same kv_transfer_config as the engine.
        config = ConnectorConfig.from_kv_transfer_config(vllm_config.kv_transfer_config)
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, config.role, config.engine_id)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self.scheduler_side.shutdown()
