#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
# Runs the push/pull sweep against a running P (:8100) and D (:8200) pair (see serve_pd.sh).
#
#   MODE=push CONTROL_PLANE=10.0.0.2:50051 KVPUSH_TOKEN_FILE=router PREFILL_IP=10.0.0.5 DECODE_IP=10.0.0.6 ./run_sweep.sh
#   (KVPUSH_TOKEN_FILE: the router's own token file, `router` from `kvpush tokens`)
#   DRY_RUN=1 MODE=pull ./run_sweep.sh      # print the commands, run nothing
#
# It starts `kvpush router` in MODE and runs `vllm bench serve` per (QPS, input length, output
# length, iteration), writing results/<mode>_qps<q>_in<in>_out<out>_iter<i>.json and .log.
# (The repository's own sweep, which starts its engines itself, is `python -m bench.sweep`.)
set -euo pipefail

MODE=${MODE:?MODE must be push, pull or upstream-push}
PREFILL_IP=${PREFILL_IP:-127.0.0.1}
DECODE_IP=${DECODE_IP:-127.0.0.1}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PREFILL_ENGINE_ID=${PREFILL_ENGINE_ID:-prefill-engine-001}
DECODE_ENGINE_ID=${DECODE_ENGINE_ID:-decode-engine-001}
PREFILL_KV_HOST=${PREFILL_KV_HOST:-$PREFILL_IP}
PREFILL_SIDE_CHANNEL_PORT=${PREFILL_SIDE_CHANNEL_PORT:-5600}
PREFILL_TP_SIZE=${PREFILL_TP_SIZE:-8}
PREFILL_PP_SIZE=${PREFILL_PP_SIZE:-1}
CONTROL_PLANE=${CONTROL_PLANE:-}
KVPUSH_TOKEN_FILE=${KVPUSH_TOKEN_FILE:-}
ROUTER_PORT=${ROUTER_PORT:-8000}
MODEL=${MODEL:-Qwen/Qwen3-32B}
SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-Qwen}
QPS_LIST=${QPS_LIST:-1 2 4 8}
INPUT_LENS=${INPUT_LENS:-1024 4096 16384}
OUTPUT_LENS=${OUTPUT_LENS:-128}
ITERATIONS=${ITERATIONS:-1}
NUM_PROMPTS=${NUM_PROMPTS:-200}
RESULTS_DIR=${RESULTS_DIR:-results}
PID_DIR=${PID_DIR:-/tmp/kvpush-bench}
KVPUSH=${KVPUSH:-kvpush}
VLLM=${VLLM:-vllm}

run() {
  if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

router=("$KVPUSH" router --listen "0.0.0.0:$ROUTER_PORT" --mode "$MODE"
  --prefill "http://$PREFILL_IP:$PREFILL_PORT=$PREFILL_ENGINE_ID" --decode "http://$DECODE_IP:$DECODE_PORT=$DECODE_ENGINE_ID")
case "$MODE" in
  push)
    [[ -n "$CONTROL_PLANE" && -n "$KVPUSH_TOKEN_FILE" ]] || { echo "run_sweep.sh: MODE=push needs CONTROL_PLANE and KVPUSH_TOKEN_FILE" >&2; exit 2; }
    router+=(--control-plane "$CONTROL_PLANE" --token-file "$KVPUSH_TOKEN_FILE") ;;
  upstream-push)
    router+=(--prefill-kv-host "$PREFILL_KV_HOST" --prefill-side-channel-port "$PREFILL_SIDE_CHANNEL_PORT"
      --prefill-tp-size "$PREFILL_TP_SIZE" --prefill-pp-size "$PREFILL_PP_SIZE") ;;
  pull) ;;
  *) echo "run_sweep.sh: MODE must be push, pull or upstream-push, not '$MODE'" >&2; exit 2 ;;
esac

mkdir -p "$RESULTS_DIR" "$PID_DIR"
if [[ -n "${DRY_RUN:-}" ]]; then
  run "${router[@]}"
else
  "${router[@]}" > "$RESULTS_DIR/router-$MODE.log" 2>&1 &
  router_pid=$!
  echo "$router_pid" > "$PID_DIR/router.pid"
  trap 'kill "$router_pid" 2>/dev/null; wait "$router_pid" 2>/dev/null; rm -f "$PID_DIR/router.pid"' EXIT
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$ROUTER_PORT/health" >/dev/null && break
    kill -0 "$router_pid" 2>/dev/null || { echo "run_sweep.sh: the router exited; see $RESULTS_DIR/router-$MODE.log" >&2; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$ROUTER_PORT/health" >/dev/null || { echo "run_sweep.sh: router or engines not healthy after 120 s" >&2; exit 1; }
fi

for qps in $QPS_LIST; do
  for input_len in $INPUT_LENS; do
    for output_len in $OUTPUT_LENS; do
      for iteration in $(seq "$ITERATIONS"); do
        name="${MODE}_qps${qps}_in${input_len}_out${output_len}_iter${iteration}"
        echo "run_sweep.sh: $name" >&2
        run "$VLLM" bench serve --backend openai --base-url "http://127.0.0.1:$ROUTER_PORT" --endpoint /v1/completions \
          --model "$MODEL" --served-model-name "$SERVED_MODEL_NAME" --dataset-name random --random-input-len "$input_len" \
          --random-output-len "$output_len" --ignore-eos --request-rate "$qps" --num-prompts "$NUM_PROMPTS" \
          --save-result --result-dir "$RESULTS_DIR" --result-filename "$name.json"
      done
    done
  done
done
