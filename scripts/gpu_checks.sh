#!/usr/bin/env bash
# Every GPU check of the repository in one run, for a one-GPU machine with PyTorch (no SGLang needed):
#   1. the trainer's step at Kimi-K2.5's size, Llama layout (scripts/gpu_check_trainer.py), windows up to 32K,
#      then the chunked log-sum-exp form of its attention at two windows, to compare;
#   2. the same with the MLA draft layout (Kimi-K2.5's attention shapes);
#   3. the capture plugin's device copy at Kimi-K2.5's width (scripts/gpu_check_capture_copy.py);
#   4. the gpu-marked tests but those that run the two scripts again (device copy, training the tiny draft).
# Each step has its own time limit and its own log; a failed step does not stop the next. The last lines are
# one "step: OK|FAILED (exit N, S s)" each, also in OUT_DIR/summary.txt with the device; the exit code is non-zero
# if any step failed. Eight files in all (a log per step, two JSON reports, the summary).
#
#   bash scripts/gpu_checks.sh OUT_DIR
#
# Besides PyTorch it needs numpy, zstandard, xxhash, pydantic, pydantic-settings, safetensors, transformers and
# pytest importable (pyproject.toml's trainer and plugin extras); from the repository root, no install of it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
summary=()
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: runs it with its log in $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "=== $name (limit ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    local line="$name: $([ "$code" = 0 ] && echo OK || echo FAILED) (exit $code, $((SECONDS - started)) s)"
    summary+=("$line")
    [ "$code" = 0 ] || failed=1
}

device=$(nvidia-smi -L 2>&1; $python -c "import torch, sys; print('python', sys.version.split()[0], 'torch',
    torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" 2>&1)
echo "$device"

step trainer_llama 200 $python scripts/gpu_check_trainer.py --windows 2048,4096,8192,16384,32768 \
    --json "$out/trainer_llama.json"
step trainer_llama_chunked 120 $python scripts/gpu_check_trainer.py --attention chunked --windows 2048,8192
step trainer_mla 150 $python scripts/gpu_check_trainer.py --layout mla --windows 2048,8192,16384 \
    --json "$out/trainer_mla.json"
step capture_copy 120 $python scripts/gpu_check_capture_copy.py
step gpu_tests 200 $python -m pytest -q -p no:cacheprovider -m gpu tests/test_plugin_device_copy_gpu.py \
    tests/test_trainer_train.py

printf '%s\n' "$device" "${summary[@]}" | tee "$out/summary.txt"
exit $failed
