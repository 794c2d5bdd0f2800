#!/usr/bin/env bash
# One GPU check, for a machine with an NVIDIA GPU (the device machine a session may be
# lent; it cannot reach the network, so it uses the Python it has). Under 10 minutes.
#
#   bash scripts/gpu-check.sh            # results in ${OUT:-./gpu-results}/
#
# 1. kernels: tests/kernels on CUDA (the real Triton kernels against the torch
#    reference, bit for bit, including the DSA indexer's one-row-per-page layout);
# 2. benchmarks: bench_kernels.py (digest vs copy bandwidth), bench_generation_tags.py
#    --device cuda (per decode step), bench_dsa_coverage.py --device cuda with a GLM-5 /
#    DeepSeek-V3.2 shape (61 layers, 128 pages of 64 tokens, bf16 and fp8 latent KV);
# 3. where this Python has SGLang: the MLA / DSA / draft / MXFP8 component tests on CUDA
#    pools (KVGUARD_COMPONENT_DEVICE=cuda): SGLang's real DSATokenToKVPool etc. on the
#    GPU, the guards' Triton kernels on the real layouts.
# The DSA indexer has no CPU path in SGLang, so a DSA PD *server* test needs SGLang's
# CUDA stack (sgl-kernel, DeepGEMM) installed on the GPU machine; without it this script
# says so and stops after step 3 (docs/testing.md).
#
#   bash scripts/gpu-check.sh --cpu-dry-run   # the same steps on CPU (Triton interpreted, small
#                                             # shapes): catches a broken step before device time is spent
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
step() { echo "=== $*" >&2; }
DEV=cuda
SHAPE=(--layers 61 --pages 128)
KERNEL_ARGS=()
GEN_ARGS=()
if [[ ${1:-} == --cpu-dry-run ]]; then
  DEV=cpu
  SHAPE=(--layers 2 --pages 8)
  KERNEL_ARGS=(--quick --no-cuda)
  GEN_ARGS=(--batch 1 8 --context 1024 --reps 5)
  export TRITON_INTERPRET=1
  echo "gpu-check: CPU dry run (TRITON_INTERPRET=1, small shapes): figures are not GPU figures" | tee "$OUT/device.txt"
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: torch with CUDA is not importable from $PY" >&2
  exit 2
else
  "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export KVGUARD_AUTO_INSTALL=0

step "kernels on $DEV"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --junitxml="$OUT/kernels.xml" \
  > "$OUT/kernels.log" 2>&1 || status=1
tail -n 3 "$OUT/kernels.log" >&2

step "benchmarks"
timeout 120 "$PY" benchmarks/bench_kernels.py "${KERNEL_ARGS[@]}" > "$OUT/bench_kernels.json" \
  2> "$OUT/bench_kernels.err" || status=1
timeout 120 "$PY" benchmarks/bench_generation_tags.py --device $DEV "${GEN_ARGS[@]}" > "$OUT/bench_generation_tags.json" \
  2> "$OUT/bench_generation_tags.err" || status=1
for dt in bf16 fp8; do
  timeout 90 "$PY" benchmarks/bench_dsa_coverage.py --device $DEV "${SHAPE[@]}" --dtype $dt \
    --out "$OUT/bench_dsa_coverage_$dt.json" > /dev/null 2> "$OUT/bench_dsa_coverage_$dt.err" || status=1
done
for f in "$OUT"/bench_*.err; do [[ -s $f ]] && { echo "--- $f" >&2; tail -n 3 "$f" >&2; }; done

if "$PY" -c "import sglang" 2>/dev/null; then
  step "MLA / DSA / draft / MXFP8 component tests on $DEV pools"
  KVGUARD_COMPONENT_DEVICE=$DEV timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/component/test_mla_dsa_draft_integrity.py tests/component/test_transfer_components.py \
    --junitxml="$OUT/component-cuda.xml" > "$OUT/component-cuda.log" 2>&1 || status=1
  tail -n 3 "$OUT/component-cuda.log" >&2
else
  echo "gpu-check: no SGLang in $PY: the component tests on CUDA pools and a DSA PD server test need it" \
    | tee "$OUT/sglang-missing.txt" >&2
fi
exit $status
