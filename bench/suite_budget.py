"""Where a test suite run's time went, against the 30 minutes it should take on 2 cores (issue 56).

Reads what a full run leaves: its output (``pytest --durations=0``, and ``/usr/bin/time -v``
around it where present) and its base temporary folder (``--basetemp``), which holds every
workflow run's ``benchmarks/`` and every vLLM server log. Prints

- the worker-seconds of each scope the workers run whole (a module, or a twin's run), largest
  first, and how many the 30 minutes leave to two workers;
- the run's CPU seconds (user + system) and how many cores it kept busy on average;
- the workflow jobs by rule: how many ran, their CPU seconds by their benchmarks (a job's last
  run per folder: Snakemake writes a rule's benchmark again when it reruns; copies counted once;
  a server's engine process, which vLLM spawns, is mostly missed by the benchmark's sampling);
- the vLLM servers the workflow started (the pid lines of every ``*.server.log``, copies of a log
  counted once; servers a test starts itself log elsewhere).

    CI=true PYTEST_ADDOPTS="--basetemp /tmp/pt --durations=0" /usr/bin/time -v bash .ci/run > run.log 2>&1
    PYTHONPATH=. .venv/bin/python bench/suite_budget.py run.log /tmp/pt
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from tests.scopes import scope

BUDGET_S = 30 * 60
WORKERS = 2
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)")
PID_LINE = "--- its pid and process group: "  # draftflow.vllm_server's, after each start marker


def scope_seconds(log: str) -> Counter:
    seconds = Counter()
    for line in log.split("slowest durations", 1)[-1].splitlines():
        if match := DURATION.match(line):
            seconds[scope(match[2])] += float(match[1])
    return seconds


def cpu_seconds(log: str) -> tuple[float, float] | None:
    """User + system CPU seconds and the wall seconds of pytest itself, where the log has both."""
    user, system = (re.search(rf"{name} time \(seconds\): ([\d.]+)", log) for name in ("User", "System"))
    wall = re.search(r"=+ .* in ([\d.]+)s", log)
    if not (user and system and wall):
        return None
    return float(user[1]) + float(system[1]), float(wall[1])


def job_cpu(basetemp: Path) -> tuple[Counter, Counter]:
    """Jobs and CPU seconds by rule, from every benchmark file under ``basetemp``."""
    jobs, cpu, seen = Counter(), Counter(), set()
    for path in basetemp.rglob("benchmarks/**/*.tsv"):
        lines = path.read_text().splitlines()
        if len(lines) < 2 or (path.name, lines[1]) in seen:  # none, or a copy of a run's benchmark
            continue
        seen.add((path.name, lines[1]))
        rule = re.sub(r"-\d+$", "", path.stem)  # a shard's or a server's job: its rule
        jobs[rule] += 1
        cpu[rule] += float(lines[1].split("\t")[-1])
    return jobs, cpu


def server_starts(basetemp: Path) -> Counter:
    """Distinct vLLM server starts by log name (a test's copy of a run holds its logs again)."""
    seen, starts = set(), Counter()
    for path in basetemp.rglob("*.server.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(PID_LINE) and line not in seen:
                seen.add(line)
                starts[re.sub(r"-\d+$", "", path.name.removesuffix(".server.log"))] += 1
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the run's output, with pytest's --durations=0")
    parser.add_argument("basetemp", type=Path, help="the run's --basetemp folder")
    args = parser.parse_args()
    log = args.log.read_text(errors="replace")

    seconds = scope_seconds(log)
    total = sum(seconds.values())
    print(f"worker-seconds: {total:.0f} in {len(seconds)} scopes; {WORKERS} workers in {BUDGET_S // 60} min "
          f"have {WORKERS * BUDGET_S}: {total / (WORKERS * BUDGET_S):.2f}x the budget")  # fmt: skip
    for name, value in seconds.most_common(25):
        print(f"  {value:7.0f}  {name}")
    if measured := cpu_seconds(log):
        cpu, wall = measured
        print(f"CPU: {cpu:.0f} s (user + system) over pytest's {wall:.0f} s: {cpu / wall:.2f} cores busy on average; "
              f"at that rate {BUDGET_S} s hold {cpu / wall * BUDGET_S:.0f} CPU-s")  # fmt: skip

    jobs, cpu = job_cpu(args.basetemp)
    print(f"workflow jobs: {sum(jobs.values())}, {sum(cpu.values()):.0f} CPU-s by their benchmarks")
    for rule, value in cpu.most_common():
        print(f"  {value:7.0f}  {rule} ({jobs[rule]} jobs, {value / jobs[rule]:.1f} each)")

    starts = server_starts(args.basetemp)
    print(f"vLLM servers started: {sum(starts.values())}")
    for name, count in starts.most_common():
        print(f"  {count:4d}  {name}")


if __name__ == "__main__":
    main()
