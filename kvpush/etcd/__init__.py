# SPDX-License-Identifier: Apache-2.0
"""etcd v3 client and lease keeper for kvpush's scaled-out control plane."""
