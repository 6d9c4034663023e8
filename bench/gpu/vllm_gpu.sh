#!/usr/bin/env bash
# The whole demo workflow on one GPU with vLLM (issue 58): demo_target, prompts,
# generate (a vLLM server on the GPU), prepare, vocab_map, extract (the vllm backend),
# fidelity, train, evaluate, serve_check (vLLM's own counters), report; then the
# served speed with and without the drafter (bench/gpu/served_speed.py) and the
# extraction again with the transformers backend on the same target, for its rate.
# After `make install DEVICE=cuda WHEELHOUSE=wheelhouse PYTHON=python3` (docs/install.md):
#   PY=.venv-cuda/bin/python bash bench/gpu/vllm_gpu.sh OUT_DIR
set -uo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu-vllm}")
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
configs=(config/config.yaml bench/gpu/demo-gpu-vllm.yaml)
PY=${PY:-python3}  # .venv-cuda/bin/python after `make install DEVICE=cuda WHEELHOUSE=...`
sm=("$PY" -m snakemake --cores "$(nproc)" --resources gpu=1 --scheduler greedy --keep-going)
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tail -3 | tee "$OUT/vllm-version.txt"
started=$(date +%s)
"${sm[@]}" --configfile "${configs[@]}" >"$OUT/workflow.log" 2>&1
status=$?
echo "workflow exit status $status after $(($(date +%s) - started)) s" | tee -a "$OUT/workflow.log"
grep -E "Error|error:|Exiting|Finished job|steps \(" "$OUT/workflow.log" | tail -30
mkdir -p "$OUT/run"
cp -r results/gpu-vllm/evaluation results/gpu-vllm/synthetic/stats.json results/gpu-vllm/hidden_states/manifest.json \
    results/gpu-vllm/report "$OUT/run/" 2>/dev/null
cp -r logs/gpu-vllm benchmarks/gpu-vllm "$OUT/run/" 2>/dev/null
"$PY" bench/gpu/workflow_report.py --all-on-gpu results/gpu-vllm benchmarks/gpu-vllm --out "$OUT/workflow_report.md" && cat "$OUT/workflow_report.md"
for log in logs/gpu-vllm/*.log; do echo "== $log"; tail -5 "$log"; done 2>/dev/null | tail -80
# the drafter trained even where a later rule failed (fidelity, on the GPU: BENCHMARKS.md)
if [ -d results/gpu-vllm/drafter_trained ] && [ "${SPEED:-1}" = 1 ]; then
    timeout "${SPEED_TIMEOUT:-400}" "$PY" bench/gpu/served_speed.py --graphs --configfile "${configs[@]}" --out "$OUT/served_speed.json" 2>&1 | tail -40
fi
# the same extraction with the transformers backend (another key: the vllm backend's files are replaced)
if [ "${TRANSFORMERS:-1}" = 1 ]; then
    printf 'extract:\n  backend: transformers\n' >"$OUT/transformers.yaml"
    timeout "${TRANSFORMERS_TIMEOUT:-320}" "${sm[@]}" --configfile "${configs[@]}" "$OUT/transformers.yaml" -- \
        results/gpu-vllm/hidden_states/manifest.json >"$OUT/transformers.log" 2>&1
    cp benchmarks/gpu-vllm/extract_server-0.tsv "$OUT/transformers-extract_server-0.tsv"
fi
exit $status
