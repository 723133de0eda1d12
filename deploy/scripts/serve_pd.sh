#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# Serves one prefill or decode vLLM engine of the 1P1D benchmark topology (prefill on :8100, decode on :8200).
#
#   ROLE=prefill MODE=push CONTROL_PLANE=10.0.0.2:50051 KVPUSH_TOKEN_FILE=/etc/kvpush/prefill-engine-001 ./serve_pd.sh
#   ROLE=decode  MODE=pull PREFILL_IP=10.0.0.5 DECODE_IP=10.0.0.6 ./serve_pd.sh
#   DRY_RUN=1 ROLE=decode MODE=upstream-push ./serve_pd.sh     # print the command, run nothing
#
# MODE: push (kvpush's KvpushConnector: needs CONTROL_PLANE and this engine's own token file,
#       its identity's file from `kvpush tokens`, named like its engine id),
#       pull (upstream NixlConnector), upstream-push (upstream NixlPushConnector).
# The server runs in the foreground; its PID goes to $PID_DIR/serve_<role>.pid for cleanup.sh.
set -euo pipefail

ROLE=${ROLE:?ROLE must be prefill or decode}
MODE=${MODE:?MODE must be push, pull or upstream-push}
MODEL=${MODEL:-Qwen/Qwen3-32B}
SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-Qwen}
DTYPE=${DTYPE:-bfloat16}
TP_SIZE=${TP_SIZE:-8}
PP_SIZE=${PP_SIZE:-1}  # pipeline-parallel size; above 1 on a prefill engine only (kvpush writes into decode engines of PP 1)
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32768}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PREFILL_ENGINE_ID=${PREFILL_ENGINE_ID:-prefill-engine-001}
DECODE_ENGINE_ID=${DECODE_ENGINE_ID:-decode-engine-001}
PREFILL_IP=${PREFILL_IP:-127.0.0.1}
DECODE_IP=${DECODE_IP:-127.0.0.1}
SIDE_CHANNEL_PORT=${SIDE_CHANNEL_PORT:-5600}
# off (the benchmark's default: every request's whole KV crosses from P to D, the thing measured) or on.
PREFIX_CACHING=${PREFIX_CACHING:-off}
KV_BUFFER_DEVICE=${KV_BUFFER_DEVICE:-cuda}
NIXL_BACKENDS=${NIXL_BACKENDS:-UCX}  # LIBFABRIC on EFA
CONTROL_PLANE=${CONTROL_PLANE:-}
KVPUSH_TOKEN_FILE=${KVPUSH_TOKEN_FILE:-}
VLLM=${VLLM:-vllm}
PID_DIR=${PID_DIR:-/tmp/kvpush-bench}
EXTRA_ARGS=${EXTRA_ARGS:-}

case "$ROLE" in
  prefill) kv_role=kv_producer; port=$PREFILL_PORT; engine_id=$PREFILL_ENGINE_ID; own_ip=$PREFILL_IP ;;
  decode) kv_role=kv_consumer; port=$DECODE_PORT; engine_id=$DECODE_ENGINE_ID; own_ip=$DECODE_IP ;;
  *) echo "serve_pd.sh: ROLE must be prefill or decode, not '$ROLE'" >&2; exit 2 ;;
esac

backends_json=$(printf '"%s",' ${NIXL_BACKENDS//,/ }); backends_json="[${backends_json%,}]"
case "$MODE" in
  push)
    [[ -n "$CONTROL_PLANE" && -n "$KVPUSH_TOKEN_FILE" ]] || { echo "serve_pd.sh: MODE=push needs CONTROL_PLANE=host:port and KVPUSH_TOKEN_FILE" >&2; exit 2; }
    kv_config="{\"kv_connector\":\"KvpushConnector\",\"kv_role\":\"$kv_role\",\"engine_id\":\"$engine_id\",\"kv_connector_extra_config\":{\"control_plane\":\"$CONTROL_PLANE\",\"token_file\":\"$KVPUSH_TOKEN_FILE\",\"backends\":$backends_json}}"
    ;;
  pull | upstream-push)
    connector=NixlConnector
    [[ "$MODE" == upstream-push ]] && connector=NixlPushConnector
    kv_config="{\"kv_connector\":\"$connector\",\"kv_buffer_device\":\"$KV_BUFFER_DEVICE\",\"kv_role\":\"$kv_role\",\"engine_id\":\"$engine_id\",\"kv_connector_extra_config\":{\"backends\":$backends_json}}"
    # Upstream's side channel: D advertises it to P (push), P to D (pull); it must be routable.
    export VLLM_NIXL_SIDE_CHANNEL_HOST=$own_ip VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_CHANNEL_PORT
    ;;
  *) echo "serve_pd.sh: MODE must be push, pull or upstream-push, not '$MODE'" >&2; exit 2 ;;
esac

if [[ "$ROLE" == decode && "$MODE" == push && "$PP_SIZE" != 1 ]]; then
  echo "serve_pd.sh: PP_SIZE=$PP_SIZE: kvpush writes into decode engines of pipeline-parallel size 1 (a prefill engine may be pipeline-parallel)" >&2
  exit 2
fi
case "$PREFIX_CACHING" in
  off) prefix_caching=--no-enable-prefix-caching ;;
  on) prefix_caching=--enable-prefix-caching ;;
  *) echo "serve_pd.sh: PREFIX_CACHING must be off or on, not '$PREFIX_CACHING'" >&2; exit 2 ;;
esac
cmd=("$VLLM" serve "$MODEL" --served-model-name "$SERVED_MODEL_NAME" --dtype "$DTYPE" --tensor-parallel-size "$TP_SIZE"
  --pipeline-parallel-size "$PP_SIZE" --max-model-len "$MAX_MODEL_LEN" --max-num-seqs "$MAX_NUM_SEQS" --host 0.0.0.0 --port "$port" "$prefix_caching"
  --kv-transfer-config "$kv_config")
# shellcheck disable=SC2206  # EXTRA_ARGS is a word list on purpose
cmd+=($EXTRA_ARGS)

if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
mkdir -p "$PID_DIR"
echo $$ > "$PID_DIR/serve_$ROLE.pid"
echo "serve_pd.sh: $ROLE ($MODE) on :$port, engine_id $engine_id" >&2
exec "${cmd[@]}"
