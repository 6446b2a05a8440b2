#!/usr/bin/env bash
# What the developers run on the GPU machine after every change to CUDA code: build for the GPU,
# then the named steps.   bash benchmarks/gpu_check.sh [tests] [sanitize] [bench] [documents] [rotary] [long] [profile] [ncu]
#   tests     the whole test suite's CUDA half (device-parametrised tests, test_cuda.py, test_tensor_cores.py)
#             and the error-message tests (the machine's own build of the host code)
#   sanitize  compute-sanitizer memcheck and racecheck on a small grid of shapes, each tool cut at
#             SANITIZE_TIMEOUT s (300; racecheck took over 200 s on 2026-12-07), SANITIZE_DTYPES
#             names a part of the grid (e.g. float16: the tensor-core kernels)
#   bench     benchmarks/bench_attention.py on the GPU, JSON into $OUT; BENCH_SETS picks the case sets,
#             BENCH_ARGS adds options (a quick look: BENCH_ARGS="--impls rudnn,flash --modes fwd")
#   documents benchmarks/bench_documents.py: packed documents, 64k-256k tokens, JSON into $OUT
#   rotary    benchmarks/bench_rotary.py: fused RoPE against RoPE first, JSON into $OUT
#   long      L = S = 65536, E = 64, bf16, causal, forward and backward: time and peak memory
#   profile   per-kernel GPU time of forward and backward; PROFILE_ARGS adds options (--rope)
#   ncu       Nsight Compute on the kernels of the cases named by NCU_CASES (substrings of their
#             names, comma-separated; default: the float32 case), NCU_COUNT launches: details and
#             per-instruction stall samples into $OUT, and per launch the stall reasons and
#             busiest opcodes (benchmarks/ncu_summary.py)
set -uo pipefail
OUT=${OUT:-/tmp/rudnn-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
if [ -z "${BUILT:-}" ]; then  # BUILT=1: the caller has built the extension that `import rudnn` finds
  if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -n 60 "$OUT/build.log"
    exit 1
  fi
  echo "build: $(($(date +%s) - start)) s"
fi
status=0
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    tests)
      python3 -m pytest tests -q --maxfail=20 -k "cuda or tensor_core or test_errors" -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -n 40
      status=$((status | PIPESTATUS[0])) ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
          python3 benchmarks/sanitize_grid.py ${SANITIZE_DTYPES:-} >"$OUT/$tool.log" 2>&1
        code=$?
        echo "compute-sanitizer $tool: exit $code"
        tail -n 5 "$OUT/$tool.log"
        status=$((status | code))
      done ;;
    bench)
      python3 benchmarks/bench_attention.py --device cuda --sets "${BENCH_SETS:-issue,sweep,fallback}" ${BENCH_ARGS:-} \
        --json "$OUT/bench.json" 2>/dev/null | tee "$OUT/bench.md" ;;
    documents)
      python3 benchmarks/bench_documents.py --json "$OUT/documents.json" 2>&1 | tee "$OUT/documents.md" ;;
    rotary)
      python3 benchmarks/bench_rotary.py --json "$OUT/rotary.json" 2>&1 | tee "$OUT/rotary.md" ;;
    long)
      python3 benchmarks/long_rows.py 2>&1 | tee "$OUT/long.log" ;;
    profile)
      python3 benchmarks/profile_kernels.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" | grep -v "^-" ;;
    ncu)
      ncu --clock-control none --set full --import-source yes -k regex:attention -c "${NCU_COUNT:-3}" -f -o /tmp/rudnn-kernels \
        python3 benchmarks/profile_kernels.py --cases "${NCU_CASES:-float32}" --once ${PROFILE_ARGS:-} >"$OUT/ncu.log" 2>&1
      ncu --import /tmp/rudnn-kernels.ncu-rep --page details >"$OUT/ncu_details.txt" 2>&1
      ncu --import /tmp/rudnn-kernels.ncu-rep --page source --csv --print-source sass >"$OUT/ncu_source.csv" 2>&1
      tail -n 3 "$OUT/ncu.log"; grep -E "^  [a-z_]+.*\(|Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Achieved Occ" "$OUT/ncu_details.txt"
      python3 benchmarks/ncu_summary.py "$OUT/ncu_source.csv" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "$step: $(($(date +%s) - start)) s"
done
exit $status
