#!/usr/bin/env bash
# The GPU checks as one call, for a machine whose python3 already has torch with CUDA and no
# network (`make test-gpu` builds .venv from the package index first, which such a machine
# cannot reach): the GPU tier (`pytest -m cuda`), then `wholeshard bench --device cuda` on one
# GPU. Each part is stopped with SIGINT at its limit, so pytest still prints the failures so far.
#
#   OUT=runs/gpu TEST_S=420 BENCH_S=120 tools/gpu_check.sh
#
# Writes test-gpu.log, bench.md, bench.json, bench.png and bench.err under $OUT. The tier took
# about 7 minutes on one H200 (2026-11-27) and did not finish in 400 s on one H100 (2026-12-06:
# tests/gpu/test_cuda.py alone 397 s), so the files run shortest first and the bench forks its
# workers (`--quick`; spawned, each configuration took about 9 s to start). With a 15-minute
# device budget, TEST_S=420 BENCH_S=120 leaves room for the machine's start.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
timeout -s INT -k 15 "${TEST_S:-420}" python3 -m pytest -q -rfEs --tb=short -m cuda \
    -p no:cacheprovider --durations=15 tests/gpu/test_cuda_bench.py tests/gpu/test_cuda_fp8.py \
    tests/gpu/test_cuda_offload.py tests/optim/test_batched_muon.py tests/gpu/test_cuda.py \
    2>&1 | tee "$out/test-gpu.log"
echo "pytest exit: ${PIPESTATUS[0]}"
timeout -s INT -k 15 "${BENCH_S:-120}" python3 -m wholeshard bench --device cuda --nproc 1 --quick \
    --workload mlp --json "$out/bench.json" --png "$out/bench.png" 2>"$out/bench.err" \
    | tee "$out/bench.md"
echo "bench exit: ${PIPESTATUS[0]}"
