#!/usr/bin/env bash
# Runs the nccl backend's tests on a machine with a GPU (CUDA driver + NCCL installed), in well under 5 minutes:
# world size 1 with the NCCL id exchanged through a rendezvous, and 2 ranks when there are 2 GPUs.
# Usage: collective/gpu-check.sh   (from anywhere; needs cargo; builds only hvd-collective)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "note: nvidia-smi not found"
ldconfig -p | grep -q libnccl || echo "warning: libnccl not in the linker cache; the tests will report NCCL as unavailable"
export RUST_BACKTRACE=1
# Fail instead of skipping when no GPU is usable: this script exists to exercise one.
timeout 280 cargo test -p hvd-collective --features nccl --test nccl -- --nocapture --test-threads=1 2>&1 | tee /tmp/hvd-gpu-check.log
if grep -q "GPU cases skipped" /tmp/hvd-gpu-check.log; then
  echo "FAIL: CUDA/NCCL not usable on this machine (see above)" >&2
  exit 1
fi
echo "gpu-check: ok"
