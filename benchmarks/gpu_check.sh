#!/usr/bin/env bash
# The GPU kit: on one GPU (sized for an H200) within 8 minutes, run
#   1. the single-GPU rows of tests/test_cuda.py under TORCH_CUDA_SANITIZER=1 (rows that need two
#      GPUs skip themselves on one),
#   2. benchmarks/ns_roofline.py --device cuda (NS as a fraction of the 989 TFLOP/s bf16 dense peak,
#      with and without Gram in fp16),
#   3. benchmarks/offload_step.py --device cuda --world 1 (ZeRO-2 with and without optimizer offload,
#      and the host-stack NS pipeline),
#   4. benchmarks/gpu_step.py --device cuda (step() against torch.optim.Muon on one GPU),
# each under its own time limit, and print one summary table for docs/PERFORMANCE.md followed by
# each part's own tables.  Without CUDA it says so and exits 0: no test depends on this script.
#
#   bash benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter, GPU_CHECK_OUT=dir for the logs
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False with $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo "no torch")): nothing run, skipped"
    exit 0
fi

OUT=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm{p.major}{p.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}")'
ROWS=()

part() {  # part NAME LIMIT_S COMMAND...: run it, keep its log, add a summary row
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - t0)) status=ok
    [ $rc -ne 0 ] && status="FAILED (rc $rc)"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="TIMED OUT after ${limit}s"
    ROWS+=("| $name | $status | $took | $(summary "$name") |")
}

summary() {  # the one line of a part's log the table shows
    local log="$OUT/$1.log"
    case $1 in
        tests) grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)' "$log" | tail -1 ;;
        roofline) grep -E '^\| +bfloat16 \| +bank ' "$log" | head -1 | tr -s ' ' ;;
        offload) grep -E '^\| +(no offload|offload) ' "$log" | tr -s ' ' | tr '\n' ' ' ;;
        step) grep -E '^torch.optim.Muon step / ds_muon step' "$log" | tail -1 ;;
    esac
}

# budgets (s): 240 + 90 + 90 + 45 = 465, under 8 minutes with the starts
part tests 240 env TORCH_CUDA_SANITIZER=1 DS_ACCELERATOR=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
part roofline 90 "$PY" benchmarks/ns_roofline.py --device cuda --rounds 7 --peak-tflops 989
part offload 90 "$PY" benchmarks/offload_step.py --device cuda --world 1 --steps 6
part step 45 "$PY" benchmarks/gpu_step.py --device cuda --steps 12

echo
echo "| part | status | seconds | result |"
echo "|------|--------|---------|--------|"
for r in "${ROWS[@]}"; do echo "$r"; done
echo
for name in tests roofline offload step; do
    echo "## $name ($OUT/$name.log)"
    if [ "$name" = tests ]; then tail -n 25 "$OUT/$name.log"; else grep -vE '^(USDT|\[)' "$OUT/$name.log"; fi
    echo
done
grep -q "FAILED\|TIMED OUT" <<<"${ROWS[*]}" && exit 1
exit 0
