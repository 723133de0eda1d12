# SPDX-License-Identifier: Apache-2.0
"""How kvpush's log lines look, in its own processes and inside an engine's."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("debug", "info", "warning", "error")


class _KvpushHandler(logging.StreamHandler):
    """The stderr handler show_kvpush_logs adds (told apart from an application's own handlers)."""


def show_kvpush_logs(level: str) -> None:
    """Prints kvpush's log lines at `level` and above on stderr, in a process whose logging kvpush does not own (a vLLM engine).

    vLLM configures only its own `vllm` logger: without this, kvpush's INFO
    lines (broker members joining and leaving, shard map revisions, a rank
    registering again) are dropped and its warnings reach stderr only
    through logging's last-resort handler. A process that configured
    logging itself (its root logger has handlers) keeps them: kvpush's
    lines propagate there at the level asked.
    """
    log = logging.getLogger("kvpush")
    log.setLevel(level.upper())
    if logging.getLogger().handlers or any(isinstance(h, _KvpushHandler) for h in log.handlers):
        return
    handler = _KvpushHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
