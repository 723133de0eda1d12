# SPDX-License-Identifier: Apache-2.0
"""etcd v3 client, lease keeper and test cluster for kvpush's scaled-out control plane."""
