# SPDX-License-Identifier: Apache-2.0
"""The kvpush vLLM KV connector plugin."""
