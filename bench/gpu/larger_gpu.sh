#!/usr/bin/env bash
# The workflow with vLLM on one GPU on a target that keeps the GPU busy, and generation's rate
# at Llama-3.1-8B's shape (issue 58), in phases that a lease's 10-minute
# commands take one after another on a warm machine: each call runs the phases not yet tried
# until DEADLINE seconds after it started (default 560), then stops; the next call goes on
# (a workflow the deadline stopped resumes; a phase tried once is not tried again). Phases:
#
#   install      .venv-cuda from wheelhouse/ (bench/gpu/install_offline.sh: a wheelhouse
#                carried in parts is joined from /tmp/parts/part-* first)
#   target       the demo's target at hidden size 1024 (115M parameters), trained on the GPU
#                (bench/gpu/larger_target.py)
#   workflow     every stage with bench/gpu/larger-vllm.yaml: generation on a vLLM server, the
#                vllm extraction backend, fidelity, speculators' Trainer, evaluate, serve_check
#                at temperatures 0, 0.7 and 1
#   speed        served tokens/s with and without the drafter on the first SPEED_PROMPTS (64)
#                held-out and MT-Bench prompts (bench/gpu/served_speed.py --graphs)
#   generation   response tokens/s of one vLLM engine on a random target of Llama-3.1-8B's shape
#                at concurrency 16, 64 and 256 (bench/gpu/generation_rate.py; the plan's rate)
#   transformers the same extraction with the transformers backend, for its rate (last: its
#                files replace the vllm backend's)
#
# What each phase measured is appended to OUT/summary.txt; its logs and the run's small
# outputs go to OUT/run.tgz at every exit.
#
#   bash bench/gpu/larger_gpu.sh OUT_DIR
set -uo pipefail
OUT=$(realpath -m "${1:-bench/results/gpu-larger}")
STATE=${STATE:-/tmp/larger-state}  # on the machine: which phases are done, their logs
mkdir -p "$OUT" "$STATE/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
deadline=${DEADLINE:-560}
PY=.venv-cuda/bin/python
configs=(config/config.yaml bench/gpu/larger-vllm.yaml)
run=results/gpu-larger
left() { echo $((deadline - SECONDS)); }
finished() { [ -f "$STATE/$1.done" ]; }
say() { echo "$*" | tee -a "$OUT/summary.txt" "$STATE/summary.txt" >/dev/null; echo "$*"; }
collect() {
    cp "$STATE/summary.txt" "$OUT/summary.txt" 2>/dev/null
    tar czf "$OUT/run.tgz" --ignore-failed-read -C "$STATE" logs served_speed.json generation_rate.json summary.txt \
        vllm-extract_server-0.tsv transformers-extract_server-0.tsv -C "$PWD" "$run/evaluation" \
        "$run/synthetic/stats.json" "$run/hidden_states/manifest.json" "$run/train/stats.json" "$run/report" \
        "$run/run_plan.md" "$run/drafter/README.md" logs/gpu-larger benchmarks/gpu-larger 2>/dev/null
}
trap collect EXIT
# A command in a process group of its own, given SECONDS: then the group (Snakemake, its jobs,
# their vLLM servers and torchrun workers) is stopped, so no server outlives it holding the GPU.
in_group() {
    local limit=$1
    shift
    setsid "$@" &
    local pid=$!
    rm -f "$STATE/timed-out"
    (sleep "$limit" && touch "$STATE/timed-out" && kill -TERM -- -"$pid" 2>/dev/null && sleep 20 && kill -KILL -- -"$pid" 2>/dev/null) &
    local watchdog=$!
    wait "$pid"
    local status=$?
    kill "$watchdog" 2>/dev/null
    kill -KILL -- -"$pid" 2>/dev/null  # what the group left running
    return $status
}

if [ ! -x "$PY" ]; then
    started=$SECONDS
    bash bench/gpu/install_offline.sh "$STATE/logs/install.log" || exit 1
    say "install: $((SECONDS - started)) s; $("$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1)"
fi

if ! finished target; then
    started=$SECONDS
    "$PY" bench/gpu/larger_target.py --out resources/larger-target --prompts resources/larger-prompts.jsonl \
        >"$STATE/target.json" 2>"$STATE/logs/target.log" || { tail -20 "$STATE/logs/target.log"; exit 1; }
    say "target: $(cat "$STATE/target.json") in $((SECONDS - started)) s" && touch "$STATE/target.done"
fi

if ! finished workflow && [ "$(left)" -gt 120 ]; then
    "$PY" -m snakemake --unlock --configfile "${configs[@]}" >/dev/null 2>&1
    started=$SECONDS
    in_group $(($(left) - 40)) "$PY" -m snakemake --cores "$(nproc)" --resources gpu=1 --scheduler greedy --keep-going \
        --rerun-incomplete --configfile "${configs[@]}" >>"$STATE/logs/workflow.log" 2>&1
    status=$?
    say "workflow: exit $status after $((SECONDS - started)) s in this call"
    grep -E "Error in rule|Finished job|steps \(|gate" "$STATE/logs/workflow.log" | tail -12
    cp benchmarks/gpu-larger/extract_server-0.tsv "$STATE/vllm-extract_server-0.tsv" 2>/dev/null
    [ -f "$STATE/timed-out" ] && exit 0  # the next call goes on
    touch "$STATE/workflow.done"  # finished, or a rule failed (the phases after it say what they lack)
fi

if ! finished speed && [ "$(left)" -gt 240 ]; then
    in_group $(($(left) - 40)) "$PY" bench/gpu/served_speed.py --graphs --configfile "${configs[@]}" \
        --prompts "${SPEED_PROMPTS:-64}" --out "$STATE/served_speed.json" >"$STATE/logs/speed.log" 2>&1
    touch "$STATE/speed.done"
    say "speed: $(tr -d '\n ' <"$STATE/served_speed.json" 2>/dev/null || tail -3 "$STATE/logs/speed.log")"
fi

if finished speed && ! finished generation && [ "$(left)" -gt 240 ]; then
    started=$SECONDS
    in_group $(($(left) - 30)) bash -c "$PY bench/gpu/generation_rate.py --model /tmp/llama-8b-shape --build &&
        $PY bench/gpu/generation_rate.py --model /tmp/llama-8b-shape --out $STATE/generation_rate.json" >"$STATE/logs/generation.log" 2>&1
    touch "$STATE/generation.done"
    say "generation: $((SECONDS - started)) s; $(tr -d '\n ' <"$STATE/generation_rate.json" 2>/dev/null || tail -5 "$STATE/logs/generation.log")"
    rm -rf /tmp/llama-8b-shape
fi

if finished generation && ! finished transformers && [ "$(left)" -gt 150 ]; then
    printf 'extract:\n  backend: transformers\n' >"$STATE/transformers.yaml"
    in_group $(($(left) - 30)) "$PY" -m snakemake --cores "$(nproc)" --resources gpu=1 --configfile "${configs[@]}" \
        "$STATE/transformers.yaml" -- "$run/hidden_states/manifest.json" >"$STATE/logs/transformers.log" 2>&1
    touch "$STATE/transformers.done"
    cp benchmarks/gpu-larger/extract_server-0.tsv "$STATE/transformers-extract_server-0.tsv" 2>/dev/null
    say "transformers: extract_server $(cut -f1 "$STATE/transformers-extract_server-0.tsv" | tail -1) s against the vllm backend's $(cut -f1 "$STATE/vllm-extract_server-0.tsv" | tail -1) s"
fi
say "phases done: $(cd "$STATE" && ls ./*.done 2>/dev/null | tr '\n' ' ')"
