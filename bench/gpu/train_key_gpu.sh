#!/usr/bin/env bash
# speculators' Trainer on the GPU, in the workflow, on RUN_DIR as bench/gpu/workflow_gpu.sh takes it
# (the stages up to vocab_map made on a CPU machine), 2 epochs each (bench/gpu/demo-gpu-short.yaml)
# (issue 57):
#
# 0. the demo's training (extraction, the untrained drafter and the views first);
# 1. `train.lr` edited (bench/gpu/demo-gpu-lr.yaml): Snakemake reruns train and evaluate; the
#    Trainer trains again from the untrained drafter (its log: the other key's checkpoints
#    removed, no resume), and ships other weights than before;
# 2. another learning rate with `train.checkpoint_every_steps: 2` (bench/gpu/demo-gpu-killed.yaml,
#    a new key): killed (its process group) once the Trainer saved a checkpoint inside an epoch,
#    then rerun: it resumes from that checkpoint (its step records go on from there).
# ONLY_KILL=1 runs the stages before training and step 2 alone.
#
# Each step prints the drafter's weight digest, the steps trained and what the log says of
# resuming; the logs go to OUT_DIR.
#
#   bash bench/gpu/train_key_gpu.sh OUT_DIR [RUN_DIR]
set -uo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu-run}")
RUN_DIR=${2:-.gpurun}
mkdir -p "$OUT"
cd "$RUN_DIR" || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# as workflow_gpu.sh runs it (mtimes only: the stages before vocab_map ran on the CPU machine with
# device: cpu), train forced to rerun; the config files after the targets
sm() { python3 -m snakemake "$@" --cores "$(nproc)" --resources gpu=1 --rerun-triggers mtime --scheduler greedy \
    --forcerun train --configfile config/config.yaml bench/gpu/demo-gpu.yaml "${edit[@]}"; }
# the stages that ran on the CPU machine marked complete (mtimes only), as workflow_gpu.sh does
sm_touch=(python3 -m snakemake --cores 1 --configfile config/config.yaml bench/gpu/demo-gpu.yaml --touch vocab_map)
drafter=results/gpu/drafter_trained/model.safetensors
summary() {
    echo "$1: drafter sha256 $(sha256sum "$drafter" | cut -c1-16), steps $(python3 -c "import json; print(json.load(open('results/gpu/train/stats.json'))['steps'])"), \
keys $(ls results/gpu/train/work | tr '\n' ' ')" | tee -a "$OUT/train-key.txt"
}
"${sm_touch[@]}" >>"$OUT/train-key.log" 2>&1
if [ -z "${ONLY_KILL:-}" ]; then
edit=(bench/gpu/demo-gpu-short.yaml)
sm train >>"$OUT/train-key.log" 2>&1 || exit 1
summary "the demo's train.lr 0.002"

echo "## 1. train.lr edited" >>"$OUT/train-key.log"
started=$(date +%s)
edit=(bench/gpu/demo-gpu-short.yaml bench/gpu/demo-gpu-lr.yaml)
sm train >>"$OUT/train-key.log" 2>&1 || exit 1
echo "train.lr edited: train reran in $(($(date +%s) - started)) s" | tee -a "$OUT/train-key.txt"
grep -E "training key|removing|resum|Fast-skipping" logs/gpu/train.log | tee -a "$OUT/train-key.txt"
summary "train.lr 0.001"
fi

echo "## 2. killed inside an epoch, then rerun" >>"$OUT/train-key.log"
edit=(bench/gpu/demo-gpu-short.yaml bench/gpu/demo-gpu-killed.yaml)
set -m  # the run in a process group of its own (its pid), which the kill takes whole
sm train >>"$OUT/train-key.log" 2>&1 &
run=$!
set +m
# a checkpoint inside an epoch: training_state.json with a local step above 0 (0: an epoch's end)
mid_epoch() { grep -qsE '"local_step": [1-9]' results/gpu/train/work/*/checkpoints/[0-9]*/training_state.json; }
for _ in $(seq 15000); do mid_epoch && break; kill -0 $run 2>/dev/null || break; sleep 0.02; done
kill -9 -- -$run 2>/dev/null  # Snakemake, the job, torchrun and its workers
wait $run 2>/dev/null
echo "killed at: $(cat results/gpu/train/work/*/checkpoints/[0-9]*/training_state.json | tr '\n' ' ')" | tee -a "$OUT/train-key.txt"
before=$(wc -l < results/gpu/train/work/*/metrics.jsonl)
sm --unlock >>"$OUT/train-key.log" 2>&1
sm --rerun-incomplete train >>"$OUT/train-key.log" 2>&1 || exit 1
grep -E "training key|removing|resum|Fast-skipping|Resuming" logs/gpu/train.log | tee -a "$OUT/train-key.txt"
python3 - "$before" <<'EOF' | tee -a "$OUT/train-key.txt"
import glob, json, sys
steps = [r["step"] for r in map(json.loads, open(glob.glob("results/gpu/train/work/*/metrics.jsonl")[0])) if "step" in r]  # step records, not the ranks' peak memory
before = int(sys.argv[1])
print(f"step records: {before} before the kill (last {steps[before - 1]}), then from {steps[before]} to {steps[-1]}")
EOF
summary "train.lr 0.0015, checkpoint every 2 steps, killed and resumed"
cp logs/gpu/train.log "$OUT/train-resumed.log"
