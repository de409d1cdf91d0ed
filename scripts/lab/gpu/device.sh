#!/usr/bin/env bash
# On the device H200 (through the device tool, carry [".gpulab"]): set the GPU lab up from the pack
# (scripts/lab/gpu/pack.py) and run what the arguments name, printing JSON lines:
#   bash scripts/lab/gpu/device.sh cases evidence [CASE ...]   # ddtree_sglang_gpu_lab.cases
#   bash scripts/lab/gpu/device.sh pytest tests/gpu [ARGS ...] # the device suite
#   bash scripts/lab/gpu/device.sh python SCRIPT [ARGS ...]    # any script in the lab's environment
# Several commands in one call: separate them with ' ++ '. What comes back under $OUT: the JSON lines
# (results.jsonl), every server log (logs.tar.xz) and the compiled-kernel caches (jit-cache.tar.xz:
# copy it to .gpulab/ here and the next call skips those compiles).
set -uo pipefail
cd "$(dirname "$0")/../../.."
REPO=$PWD
PACK=$REPO/.gpulab
LAB=/tmp/gpulab
OUT=${OUT:-/tmp/gpulab-out}
mkdir -p "$LAB" "$OUT"
t0=$(date +%s)

if [ ! -x "$LAB/venv/bin/python" ]; then
    # The device's python3 is itself a venv (/opt/torch/.venv) holding torch: a venv made from it
    # sees the base interpreter only, so the lab's venv adds the torch venv's site-packages after its
    # own (what the lab installs, transformers 5.19 among it, comes first; 00_ sorts the .pth before
    # the lab layers' boot hooks, which import torch).
    TORCH_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m venv "$LAB/venv" || exit 1
    SITE=$("$LAB/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$TORCH_SITE')" > "$SITE/00_device_torch.pth"
    "$LAB/venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        "$PACK"/wheels/*.whl || exit 1
    tar -xJf "$PACK/sglang-py.tar.xz" -C "$SITE" || exit 1
    tar -xJf "$PACK/models.tar.xz" -C "$LAB" || exit 1
    if [ -f "$PACK/jit-cache.tar.xz" ]; then tar -xJf "$PACK/jit-cache.tar.xz" -C "$LAB"; fi
fi
echo "{\"case\": \"setup\", \"seconds\": $(( $(date +%s) - t0 ))}" | tee -a "$OUT/results.jsonl"

export PATH="$LAB/venv/bin:$PATH"
export DDTREE_REPO=$REPO
# This checkout's code first (the installed wheels bring the entry points and the .pth boot hooks). The
# CPU layer's folder holds ddtree_sglang_cpu_lab.base, which the GPU layer imports (inert otherwise).
export PYTHONPATH=$REPO:$REPO/scripts/lab/sglang-gpu-lab:$REPO/scripts/lab/sglang-cpu-lab${PYTHONPATH:+:$PYTHONPATH}
export SGLANG_JIT_CACHE_DIR=$LAB/cache/sglang-jit TRITON_CACHE_DIR=$LAB/cache/triton
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d "$PACK/baseline" ]; then export DDTREE_GPU_LAB_BASELINE=$PACK/baseline; fi

status=0
# DDTREE_GPU_LAB_STEP_TIMEOUT=S stops a step after S seconds, so the call still packs the logs and the
# compile caches before the device tool's own limit ends it.
STEP_TIMEOUT=${DDTREE_GPU_LAB_STEP_TIMEOUT:+timeout --kill-after=10 $DDTREE_GPU_LAB_STEP_TIMEOUT}
run_one() {
    local kind=$1; shift
    case "$kind" in
        cases) $STEP_TIMEOUT python -m ddtree_sglang_gpu_lab.cases "$@" --models "$LAB/models" --logs "$LAB/logs" ;;
        pytest) DDTREE_GPU_LAB_MODELS=$LAB/models DDTREE_GPU_LAB_LOGS=$LAB/logs $STEP_TIMEOUT python -m pytest -p no:cacheprovider "$@" ;;
        python) $STEP_TIMEOUT python "$@" ;;
        *) echo "device.sh: unknown command '$kind' (cases, pytest or python)" >&2; return 2 ;;
    esac
}
args=()
for word in "$@" "++"; do
    if [ "$word" = "++" ]; then
        if [ ${#args[@]} -gt 0 ]; then
            run_one "${args[@]}" 2>>"$OUT/stderr.log" | tee -a "$OUT/results.jsonl" || status=1
        fi
        args=()
    else
        args+=("$word")
    fi
done

tar -cJf "$OUT/logs.tar.xz" -C "$LAB" logs 2>/dev/null
tar -cJf "$OUT/jit-cache.tar.xz" -C "$LAB" cache 2>/dev/null
echo "{\"case\": \"device.sh\", \"status\": $status, \"seconds\": $(( $(date +%s) - t0 ))}" | tee -a "$OUT/results.jsonl"
tail -c 3000 "$OUT/stderr.log" 2>/dev/null
exit $status
