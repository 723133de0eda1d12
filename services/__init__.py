# SPDX-License-Identifier: Apache-2.0
"""kvpush services: registrar, rendezvous broker, router."""
