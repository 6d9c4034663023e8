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

With ``--floors``, on an otherwise idle machine, it also measures what each of those processes
costs before it does any work, and prints the run's fixed cost: what the same processes would
take in CPU seconds if every job, server and workflow run did nothing but start:

- a job: a fresh interpreter importing what its rule's script imports (scripts/*.py's top-level
  imports), the cheapest of two;
- speculators' generation client (``python -m speculators regenerate-responses --help``), once per
  generation job whose log shows the client ran;
- a vLLM server: the demo's target served as the workflow serves it, its process group's CPU
  from launch to healthy;
- a Snakemake run: a dry run of the demo config in an empty folder (parse and plan; counted once
  per ``.snakemake/log`` file, which dry runs do not write: a floor).

    CI=true PYTEST_ADDOPTS="--basetemp /tmp/pt --durations=0" /usr/bin/time -v bash .ci/run > run.log 2>&1
    PYTHONPATH=. .venv/bin/python bench/suite_budget.py run.log /tmp/pt [--floors]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import resource
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import psutil

from draftflow.config import load_config
from draftflow.vllm_server import logged_server_pids, server_env, target_server_args, vllm_server
from tests.scopes import scope

REPO = Path(__file__).resolve().parents[1]

BUDGET_S = 30 * 60
WORKERS = CORES = 2  # make test: a worker per core
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)")


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
        for pid in set(logged_server_pids(path.read_text(errors="replace"))) - seen:
            seen.add(pid)
            starts[re.sub(r"-\d+$", "", path.name.removesuffix(".server.log"))] += 1
    return starts


def client_runs(basetemp: Path) -> int:
    """Generation jobs whose client ran (speculators' summary line), copies of a log counted once."""
    lines = set()
    for path in basetemp.rglob("logs/**/generate_server-*.log"):
        if not path.name.endswith(".server.log"):
            lines |= set(re.findall(r"^.*Pipeline complete in [\d.]+s.*$", path.read_text(errors="replace"), re.MULTILINE))
    return len(lines)


def workflow_runs(basetemp: Path) -> int:
    """Snakemake runs that were not dry runs: their log files, copies counted once."""
    return len({path.name for path in basetemp.rglob(".snakemake/log/*.snakemake.log")})


def child_cpu(command: list[str], **kwargs) -> float:
    """CPU seconds (user + system) of ``command`` run to its end, the cheapest of two runs."""
    costs = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, check=True, capture_output=True, **kwargs)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        costs.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(costs)


def rule_scripts() -> dict[str, Path]:
    """Each rule's script, from rules/*.smk."""
    scripts = {}
    for smk in (REPO / "rules").glob("*.smk"):
        for rule, script in re.findall(r"^(?:local)?rule (\w+):.*?^\s+script:\s+\"\.\./(scripts/\w+\.py)\"", smk.read_text(),
                                       re.MULTILINE | re.DOTALL):  # fmt: skip
            scripts[rule] = REPO / script
    return scripts


def import_floor(script: Path) -> float:
    tree = ast.parse(script.read_text())
    imports = [ast.unparse(node) for node in tree.body
               if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "module", None) != "__future__"]  # fmt: skip
    return child_cpu([sys.executable, "-c", "; ".join(imports)], env={**os.environ, "PYTHONPATH": str(REPO)})


def server_floor(target: Path, log_dir: Path) -> float:
    """CPU seconds of the target's server, as the demo's generation serves it, from launch to healthy."""
    settings = load_config(REPO / "config/config.yaml")
    args = target_server_args(settings["vllm"], dtype="float32", device="cpu", seed=0, trust_remote_code=False)
    log = log_dir / "floor.server.log"
    with vllm_server(str(target), args, log, env=server_env(settings["vllm"], "cpu")):
        group = logged_server_pids(log.read_text())[-1]
        return sum(sum(process.cpu_times()[:4]) for process in psutil.process_iter() if group_of(process.pid) == group)


def group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # ended since the listing
        return None


def print_floors(basetemp: Path, jobs: Counter, servers: int, run_cpu: float | None) -> None:
    scripts = rule_scripts()
    demo_target = next(basetemp.rglob("resources/demo-target"))
    with tempfile.TemporaryDirectory() as scratch:
        costs = {f"job {rule}": (count, import_floor(scripts[rule])) for rule, count in jobs.items()}
        client = [sys.executable, "-m", "speculators", "regenerate-responses", "--help"]
        costs["generation client"] = (client_runs(basetemp), child_cpu(client))
        costs["vLLM server start"] = (servers, server_floor(demo_target, Path(scratch)))
        dry_run = [str(Path(sys.executable).with_name("snakemake")), "--snakefile", str(REPO / "Snakefile"), "--directory",
                   scratch, "--configfile", str(REPO / "config/config.yaml"), "-n", "--cores", "2"]  # fmt: skip
        costs["Snakemake run"] = (workflow_runs(basetemp), child_cpu(dry_run))
    total, cpu_budget = sum(count * each for count, each in costs.values()), CORES * BUDGET_S
    print(f"fixed cost: {total:.0f} CPU-s, {total / cpu_budget:.2f}x the {cpu_budget} CPU-s that "
          f"{CORES} cores give in {BUDGET_S // 60} min")  # fmt: skip
    if run_cpu:
        print(f"  the run's other {run_cpu - total:.0f} CPU-s: the jobs' and servers' work, Snakemake's per job, the tests' own, pip's")
    for name, (count, each) in sorted(costs.items(), key=lambda item: -item[1][0] * item[1][1]):
        print(f"  {count * each:7.0f}  {name} ({count} x {each:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the run's output, with pytest's --durations=0")
    parser.add_argument("basetemp", type=Path, help="the run's --basetemp folder")
    parser.add_argument("--floors", action="store_true", help="measure each process's fixed cost (minutes; an idle machine)")
    args = parser.parse_args()
    log = args.log.read_text(errors="replace")

    seconds = scope_seconds(log)
    total = sum(seconds.values())
    print(f"worker-seconds: {total:.0f} in {len(seconds)} scopes; {WORKERS} workers in {BUDGET_S // 60} min "
          f"have {WORKERS * BUDGET_S}: {total / (WORKERS * BUDGET_S):.2f}x the budget")  # fmt: skip
    for name, value in seconds.most_common(25):
        print(f"  {value:7.0f}  {name}")
    run_cpu = None
    if measured := cpu_seconds(log):
        run_cpu, wall = measured
        print(f"CPU: {run_cpu:.0f} s (user + system) over pytest's {wall:.0f} s: {run_cpu / wall:.2f} cores busy on "
              f"average; at that rate {BUDGET_S} s hold {run_cpu / wall * BUDGET_S:.0f} CPU-s")  # fmt: skip

    jobs, cpu = job_cpu(args.basetemp)
    print(f"workflow jobs: {sum(jobs.values())}, {sum(cpu.values()):.0f} CPU-s by their benchmarks")
    for rule, value in cpu.most_common():
        print(f"  {value:7.0f}  {rule} ({jobs[rule]} jobs, {value / jobs[rule]:.1f} each)")

    starts = server_starts(args.basetemp)
    print(f"vLLM servers started: {sum(starts.values())}")
    for name, count in starts.most_common():
        print(f"  {count:4d}  {name}")
    print(f"Snakemake runs (not dry runs): {workflow_runs(args.basetemp)}; generation clients run: {client_runs(args.basetemp)}")
    if args.floors:
        print_floors(args.basetemp, jobs, sum(starts.values()), run_cpu)


if __name__ == "__main__":
    main()
