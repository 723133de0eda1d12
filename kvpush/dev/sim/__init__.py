# SPDX-License-Identifier: Apache-2.0
"""A deterministic, seeded, fault-injecting simulation of the whole kvpush protocol (see run.py)."""
