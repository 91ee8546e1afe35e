#!/usr/bin/env bash
# guidellm 0.8.1 (https://github.com/vllm-project/guidellm) against a running graphcache server.
#
#   MODEL_DIR=/path/to/model TARGET=http://127.0.0.1:8000 scripts/loadgen_guidellm.sh [guidellm run flags]
#
# MODEL_DIR is the served model's directory: guidellm loads its tokenizer (--tokenizer ...,model=DIR)
# to build prompts of an exact token length; without it guidellm looks the served model name up on
# the Hugging Face hub, which fails offline (and for a name that is not a hub repo).
# The defaults are a small fixed run: REQUESTS requests, CONCURRENCY streams, PROMPT_TOKENS in,
# OUTPUT_TOKENS out (guidellm sends ignore_eos, so every request makes exactly that many).
# Flags after the script's name go to `guidellm run` as they are (e.g. --output kind=html,path=x.html).
# The venv is separate from the project's: guidellm brings torch, transformers, datasets, ...
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LOADGEN_VENV:-.venv-load}
TARGET=${TARGET:-http://127.0.0.1:8000}
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR to the served model directory (for its tokenizer)}
MODEL=${MODEL:-}   # the served model name; empty = the first one GET /v1/models lists
ENDPOINT=${ENDPOINT:-/v1/completions}   # or /v1/chat/completions
REQUESTS=${REQUESTS:-20}
CONCURRENCY=${CONCURRENCY:-4}
PROMPT_TOKENS=${PROMPT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
OUT_DIR=${OUT_DIR:-out/guidellm}

if [ ! -x "$VENV/bin/guidellm" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "guidellm==0.8.1"
fi
mkdir -p "$OUT_DIR"
# Everything guidellm needs is local (the tokenizer directory, synthetic data): never ask the hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

exec "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$TARGET,request_format=$ENDPOINT${MODEL:+,model=$MODEL}" \
    --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --profile "kind=concurrent,streams=$CONCURRENCY" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --output "kind=json,path=$OUT_DIR/benchmarks.json" \
    --disable-progress \
    "$@"
