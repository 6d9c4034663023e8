"""What OpenMP's wait policy costs a vLLM CPU server that answers one request at a time, alone
on the machine and beside busy processes (the test suite: two workers, their workflows' jobs
and servers on two cores).

A tiny Qwen3-MoE twin (tests/twins.py) served as the workflow serves it for generation; 16
requests of 32 tokens (``ignore_eos``), one after another, as the incremental tests ask. For
each OMP_WAIT_POLICY (unset: libgomp's default, which spins before it sleeps; PASSIVE) and each
load (none; one busy process per core), the server tree's CPU seconds and the wall seconds of
the 16 answers.

    PYTHONPATH=. .venv/bin/python bench/omp_wait_policy.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

import psutil

from draftflow.config import schema, with_defaults
from draftflow.vllm_server import logged_server_pids, server_env, target_server_args, vllm_server
from tests.twins import build_twin

REQUESTS, TOKENS = 16, 32
REPEATS = 5
LOADS = (0, os.cpu_count())  # busy processes beside the server: none, one per core
POLICIES = (None, "PASSIVE")  # None: unset, libgomp's default


def spin() -> None:
    while True:
        pass


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def server_cpu_s(log: Path) -> float:
    """CPU seconds of the server's processes (its process group's leader, as draftflow logs it, and
    the leader's descendants)."""
    leader = psutil.Process(logged_server_pids(log.read_text())[-1])
    return sum(cpu_s(process) for process in (leader, *leader.children(recursive=True)))


def answer_one_at_a_time(url: str, model: str) -> None:
    for i in range(REQUESTS):
        body = {"model": model, "messages": [{"role": "user", "content": f"What is module {i} for?"}],
                "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=600) as reply:
            reply.read()


def busy(count: int):
    """``count`` processes that spin, started; kill them when done."""
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    return spinners


def measure(target: Path, policy: str | None, log: Path) -> list[dict]:
    """The server started once with ``policy``; the 16 answers REPEATS times alone, then
    REPEATS times beside a busy process per core."""
    vllm = with_defaults({}, schema())["vllm"] | {"max_model_len": 512}
    args = target_server_args(vllm, dtype="float32", device="cpu", seed=0, trust_remote_code=False)
    env = {**server_env(vllm, "cpu"), **({"OMP_WAIT_POLICY": policy} if policy else {})}
    rows = []
    with vllm_server(str(target), args, log, health_timeout_s=600, env=env) as url:
        for count in LOADS:
            spinners = busy(count)
            for _ in range(REPEATS):
                cpu, wall = server_cpu_s(log), time.monotonic()
                answer_one_at_a_time(url, str(target))
                cpu, wall = server_cpu_s(log) - cpu, time.monotonic() - wall
                rows.append({"OMP_WAIT_POLICY": policy or "unset", "busy processes": count,
                             "server CPU s": round(cpu, 1), "wall s": round(wall, 1)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            for spinner in spinners:
                spinner.kill()
    return rows


def main() -> None:
    os.environ.pop("OMP_WAIT_POLICY", None)  # "unset": libgomp's default, whatever the shell set
    with tempfile.TemporaryDirectory(prefix="omp-wait-") as folder:
        target = build_twin("qwen3_moe", Path(folder) / "target")
        rows = [row for policy in POLICIES for row in measure(target, policy, Path(folder) / f"server-{policy}.log")]
        print("\nmedians of", REPEATS)
        for policy in POLICIES:
            for count in LOADS:
                mine = [row for row in rows if (row["OMP_WAIT_POLICY"], row["busy processes"]) == (policy or "unset", count)]
                print(f"OMP_WAIT_POLICY {policy or 'unset':8} busy processes {count}: server CPU "
                      f"{median(r['server CPU s'] for r in mine):5.1f} s, wall {median(r['wall s'] for r in mine):5.1f} s")


if __name__ == "__main__":
    main()
