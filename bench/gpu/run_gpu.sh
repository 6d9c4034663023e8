#!/usr/bin/env bash
# Every GPU measurement of BENCHMARKS.md in one command, from the repo root of
# a machine with one NVIDIA GPU (two for `multi`):
#
#   bash bench/gpu/run_gpu.sh extract            # extraction (about 6.5 minutes on an H200, plus the install: EXTRACT_TIMEOUT 500 s)
#   bash bench/gpu/run_gpu.sh train              # training (about 4 minutes)
#   bash bench/gpu/run_gpu.sh compile            # packed batches against each sample alone (bench/gpu/packed_check.py), then
#                                                #   compiled against eager against fp32 on trained weights (about 6 minutes;
#                                                #   bench/gpu/compile_check.py trains a 1B-shape Llama for 200 s)
#   bash bench/gpu/run_gpu.sh in-flight          # the default extraction at in_flight 2 and 3 (about 3 minutes; bench/gpu/in_flight_sweep.py)
#   bash bench/gpu/run_gpu.sh ceiling            # the matrix rate burst and sustained, the 8B layer's products (cuBLAS, cuBLASLt),
#                                                #   a decoder's compile modes (about 4 minutes; bench/gpu/ceiling_probe.py)
#   bash bench/gpu/run_gpu.sh attention          # the packed attention's kernels: varlen flash, cuDNN varlen, none (about 2 minutes;
#                                                #   bench/gpu/ceiling_probe.py --parts attention)
#   bash bench/gpu/run_gpu.sh consumer           # the default extraction's consumer: journal fsyncs, samples in flight
#                                                #   (about 3 minutes; bench/gpu/consumer_sweep.py)
#   bash bench/gpu/run_gpu.sh fp8                # extract.storage fp8 against bf16 (about 3 minutes; bench/gpu/fp8_bench.py)
#   bash bench/gpu/run_gpu.sh fp8-train          # the Trainer on bf16 files, then on fp8 files (about 8 minutes)
#   bash bench/gpu/run_gpu.sh workflow           # the demo workflow on the GPU (about 6 minutes; bench/gpu/workflow_gpu.sh)
#   bash bench/gpu/run_gpu.sh vllm               # the whole demo workflow with vLLM on the GPU (generate, the vllm
#                                                #   extraction backend, serve_check), then served tokens/s with and
#                                                #   without the drafter (bench/gpu/vllm_gpu.sh; .venv-cuda from a wheelhouse,
#                                                #   docs/install.md, or vllm 0.26.0 in .whl/)
#   bash bench/gpu/run_gpu.sh larger             # the workflow with vLLM on a 115M-parameter target trained there, the served
#                                                #   speed, generation at Llama-3.1-8B's shape, the transformers backend: phases
#                                                #   a later call continues (bench/gpu/larger_gpu.sh; .venv-cuda from wheelhouse/)
#   bash bench/gpu/run_gpu.sh train-key          # after workflow: train.lr edited, a kill inside an epoch and the rerun
#                                                #   (bench/gpu/train_key_gpu.sh)
#   bash bench/gpu/run_gpu.sh evaluate           # evaluation's weighing of drafts at real sizes (bench/evaluate_bench.py)
#   bash bench/gpu/run_gpu.sh multi              # two GPUs against one: extraction and training (about 9.5 minutes on 2 H200s:
#                                                #   DEADLINE=585; multi-extract and multi-train run one half; bench/gpu/multi_bench.py)
#   bash bench/gpu/run_gpu.sh                    # extract + train (about 11 minutes: past one 10-minute command, so the
#                                                #   deadline stops train; on a lease run `extract` and `train` as two calls)
# Give each call at most what fits the lease's 10-minute command limit (DEADLINE, seconds).
#
# Python packages the machine lacks can sit as wheels in .whl/ (speculators,
# datasets, pydantic, snakemake, ...: BENCHMARKS.md lists them); they are
# installed to /tmp/site and put first on PYTHONPATH. Results go to $OUT
# (default bench/results/gpu-run): env.txt, extract.json, train.json and logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    # once per set of wheels on a warm machine (vllm's alone takes about a minute)
    if ! ls .whl | cmp -s - /tmp/site/.wheels; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        ls .whl >/tmp/site/.wheels
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(extract train)

{
    date -u +%FT%TZ
    uname -a
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
    nproc
    free -g | head -2
    df -hT . | tail -1
    python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "transformers", "safetensors", "datasets", "speculators", "pydantic", "snakemake", "triton", "numpy", "pyarrow"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as error:  # noqa: BLE001
        print(name, "MISSING", error)
EOF
    python3 -m snakemake --version 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"

# torch.compile (speculators compiles the drafter's forward on CUDA) needs a working inductor here
if ! timeout 120 python3 -c "
import torch
f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)
print('torch.compile ok', f(torch.randn(64, device='cuda')).shape)
" 2>&1 | tee -a "$OUT/env.txt"; then
    echo "torch.compile does not work here: training runs with TORCHDYNAMO_DISABLE=1" | tee -a "$OUT/env.txt"
    export TORCHDYNAMO_DISABLE=1
fi

# one deadline for all parts, DEADLINE seconds after this script started (install included),
# so the command ends inside the lease's limit
deadline=${DEADLINE:-560}
left() { local t=$((deadline - SECONDS)); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo "$t"; }
status=0
for part in "${parts[@]}"; do
    case "$part" in
    extract)
        timeout "$(left ${EXTRACT_TIMEOUT:-500})" python3 bench/gpu/extract_bench.py --shape 8b --keep --out "$OUT" 2>&1 | tee "$OUT/extract.log" || status=1
        ;;
    train)
        args=(--shape 8b --out "$OUT" --trainer-steps 20 --loop-steps 6 --warmup 3)
        [ -f .bench-scratch/samples.json ] && args+=(--hs-dir .bench-scratch/backend/shard-0)
        timeout "$(left ${TRAIN_TIMEOUT:-360})" python3 bench/gpu/train_bench.py "${args[@]}" 2>&1 | tee "$OUT/train.log" || status=1
        ;;
    compile)
        timeout "$(left 120)" python3 bench/gpu/packed_check.py --out "$OUT" 2>&1 | tee "$OUT/packed.log" || status=1
        timeout "$(left ${COMPILE_TIMEOUT:-420})" python3 bench/gpu/compile_check.py --out "$OUT" 2>&1 | tee "$OUT/compile.log" || status=1
        ;;
    in-flight)
        timeout "$(left 400)" python3 bench/gpu/in_flight_sweep.py --depths 2,3 --out "$OUT" 2>&1 | tee "$OUT/in-flight.log" || status=1
        ;;
    ceiling)
        timeout "$(left ${CEILING_TIMEOUT:-300})" python3 bench/gpu/ceiling_probe.py --out "$OUT" 2>&1 | tee "$OUT/ceiling.log" || status=1
        ;;
    attention)
        timeout "$(left ${CEILING_TIMEOUT:-300})" python3 bench/gpu/ceiling_probe.py --parts attention --out "$OUT" 2>&1 | tee "$OUT/attention.log" || status=1
        ;;
    consumer)
        timeout "$(left ${CONSUMER_TIMEOUT:-300})" python3 bench/gpu/consumer_sweep.py --out "$OUT" 2>&1 | tee "$OUT/consumer.log" || status=1
        ;;
    fp8)
        timeout "$(left ${FP8_TIMEOUT:-300})" python3 bench/gpu/fp8_bench.py --shape 8b --out "$OUT" 2>&1 | tee "$OUT/fp8.log" || status=1
        ;;
    fp8-train)
        # speculators' Trainer (the workflow's flags: --hidden-states-backend fp8) on bf16 files, then on fp8 files
        for storage in full fp8; do
            timeout "$(left ${FP8_TRAIN_TIMEOUT:-260})" python3 bench/gpu/train_bench.py --shape 8b --out "$OUT" --storage $storage \
                --trainer-steps 12 --warmup 3 --loops "" 2>&1 | tee "$OUT/train-$storage.log" || status=1
        done
        ;;
    workflow)
        timeout "$(left ${WORKFLOW_TIMEOUT:-480})" bash bench/gpu/workflow_gpu.sh "$OUT" || status=1
        ;;
    vllm)
        # .venv-cuda from a wheelhouse (docs/install.md), else the wheels of .whl/ installed above
        py=python3; [ -x .venv-cuda/bin/python ] && py=.venv-cuda/bin/python
        PY=$py timeout "$(left ${VLLM_TIMEOUT:-560})" bash bench/gpu/vllm_gpu.sh "$OUT" || status=1
        ;;
    larger)
        DEADLINE=$(left 580) bash bench/gpu/larger_gpu.sh "$OUT" || status=1
        ;;
    train-key)
        # after `workflow` (same machine): train.lr edited, then a kill inside an epoch and the rerun
        timeout "$(left ${TRAIN_KEY_TIMEOUT:-400})" bash bench/gpu/train_key_gpu.sh "$OUT" || status=1
        ;;
    evaluate)
        PYTHONPATH=$PWD:$PYTHONPATH timeout "$(left ${EVALUATE_TIMEOUT:-300})" python3 bench/evaluate_bench.py --device cuda \
            --out "$OUT/evaluate.json" 2>&1 | tee "$OUT/evaluate.log" || status=1
        ;;
    multi | multi-extract | multi-train)
        # several GPUs: NVLink multicast stays off (it can take a shared host's GPUs out of service)
        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
        nvidia-smi topo -m 2>&1 | tee -a "$OUT/env.txt"
        if [ "$part" != multi-train ]; then
            # the 1-GPU run's files stay in .bench-scratch/multi/hs for the training half
            timeout "$(left ${MULTI_EXTRACT_TIMEOUT:-220})" python3 bench/gpu/multi_bench.py extract --shape 8b --out "$OUT" \
                --keep .bench-scratch/multi/hs --tmpfs /dev/shm/draftflow-multi 2>&1 | tee "$OUT/multi-extract.log" || status=1
            rm -rf /dev/shm/draftflow-multi
        fi
        if [ "$part" != multi-extract ]; then
            # without the extraction's files (multi-train alone) it trains on random ones
            timeout "$(left ${MULTI_TRAIN_TIMEOUT:-420})" python3 bench/gpu/multi_bench.py train --shape 8b --out "$OUT" \
                --hs-dir .bench-scratch/multi/hs 2>&1 | tee "$OUT/multi-train.log" || status=1
        fi
        ;;
    *)
        echo "unknown part $part" && status=1
        ;;
    esac
done
rm -rf .bench-scratch
exit $status
