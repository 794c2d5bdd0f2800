#!/usr/bin/env bash
# A PD deployment (prefill + decode + sglang-router) with kvguard in every SGLang process.
# Adapt model, hosts, ports and transfer backend to your cluster; every SGLang flag
# works as with `python -m sglang.launch_server`, plus the --kvguard-* flags.
set -euo pipefail
MODEL=${MODEL:?set MODEL to your model path}

kvguard doctor || { echo "kvguard would refuse this SGLang; see above"; exit 1; }

kvguard launch --model-path "$MODEL" --port 31001 \
  --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
  --disaggregation-transfer-backend mooncake \
  --kvguard-pool-policy refuse &          # a prefill pool smaller than the context stops the node

kvguard launch --model-path "$MODEL" --port 31002 \
  --disaggregation-mode decode \
  --disaggregation-transfer-backend mooncake \
  --kvguard-max-transfer-batch 1024 &

python -m sglang_router.launch_router --pd-disaggregation \
  --prefill http://127.0.0.1:31001 8998 --decode http://127.0.0.1:31002 --port 30000 &

sleep 60
# Measure the pools, do not trust HTTP 200:
kvguard preflight http://127.0.0.1:31001 http://127.0.0.1:31002
wait
