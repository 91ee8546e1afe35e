#!/usr/bin/env bash
# aiperf 0.13 (https://github.com/ai-dynamo/aiperf) against a running graphcache server.
#
#   MODEL_DIR=/path/to/model MODEL=<served name> TARGET=http://127.0.0.1:8000 scripts/loadgen_aiperf.sh [aiperf flags]
#
# MODEL_DIR is the served model's directory: aiperf loads its tokenizer (--tokenizer DIR) to build
# prompts of an exact token length; without it aiperf looks the served model name up on the
# Hugging Face hub, which fails offline. Do NOT set HF_HUB_OFFLINE for aiperf 0.13: in offline mode
# it looks even a local directory up in the hub cache (snapshot_download) and fails; online mode
# loads a local directory without any network access.
# The defaults are a small fixed run: REQUESTS requests, CONCURRENCY at a time, PROMPT_TOKENS in,
# OUTPUT_TOKENS out (ignore_eos, so every request makes exactly that many). Token counts are the
# server's usage (--use-server-token-count): re-tokenizing streamed text miscounts, badly so for a
# random-weight model. Flags after the script's name go to `aiperf profile` as they are.
# The venv is separate from the project's: aiperf brings torch, transformers, pandas, ...
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LOADGEN_VENV:-.venv-load}
TARGET=${TARGET:-http://127.0.0.1:8000}
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR to the served model directory (for its tokenizer)}
MODEL=${MODEL:?set MODEL to the served model name (GET /v1/models)}
ENDPOINT_TYPE=${ENDPOINT_TYPE:-completions}   # or chat
REQUESTS=${REQUESTS:-20}
CONCURRENCY=${CONCURRENCY:-4}
PROMPT_TOKENS=${PROMPT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
OUT_DIR=${OUT_DIR:-out/aiperf}

if [ ! -x "$VENV/bin/aiperf" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "aiperf==0.13.*"
fi
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE

exec "$VENV/bin/aiperf" profile \
    --model "$MODEL" --tokenizer "$MODEL_DIR" --url "$TARGET" \
    --endpoint-type "$ENDPOINT_TYPE" --streaming \
    --synthetic-input-tokens-mean "$PROMPT_TOKENS" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 \
    --extra-inputs ignore_eos:true --use-server-token-count \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
    --random-seed 0 --no-gpu-telemetry --ui none \
    --artifact-dir "$OUT_DIR" \
    "$@"
