# SPDX-License-Identifier: Apache-2.0
"""kvpush: push-mode KV-cache transfer for disaggregated vLLM serving."""

__version__ = "0.1.0"
