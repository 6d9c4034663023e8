"""Where a run's jobs go and how many run at once: whether Snakemake runs them on
this machine, the extraction's server jobs, the host memory the local profile caps.

Device placement itself (which GPUs a job holds) is draftflow.gpus's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

LOCAL_EXECUTORS = {"local", "dryrun", "touch"}


def flag_values(argv: Sequence[str], long: str, short: str | None) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == long or (short and arg == short):
            if i + 1 < len(argv):
                values.append(argv[i + 1])
        elif arg.startswith(long + "="):
            values.append(arg.split("=", 1)[1])
        elif short and arg.startswith(short) and not arg.startswith("--") and len(arg) > len(short):
            values.append(arg[len(short) :])
    return values


def snakemake_runs_locally(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether this Snakemake command runs its jobs on this machine.

    For ``profiles/default``: Snakemake applies that workflow profile to every
    run, also beside ``--profile profiles/slurm``, and its keys win. Its local
    caps and per-rule resources are only emitted when this is true: no
    ``--executor``/``-e`` other than local, dryrun or touch, and no
    ``--profile`` (or ``SNAKEMAKE_PROFILE``) other than ``profiles/default``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    executors = flag_values(argv, "--executor", "-e")
    if any(executor not in LOCAL_EXECUTORS for executor in executors):
        return False
    profiles = flag_values(argv, "--profile", None)
    if not profiles and environ.get("SNAKEMAKE_PROFILE"):
        profiles = [environ["SNAKEMAKE_PROFILE"]]
    for profile in profiles:
        if profile == "none":
            continue
        path = Path(profile)
        if path.name == "config.yaml":
            path = path.parent
        if path.name != "default":
            return False
    return True


def server_gpus(config: dict) -> int:
    """GPUs one vLLM server of the target takes: tensor x data parallel (0 off CUDA)."""
    if config["device"] != "cuda":
        return 0
    return config["vllm"]["tensor_parallel_size"] * config["vllm"]["data_parallel_size"]


def concurrent_servers(
    configured: int | None, shards: int, gpus_per_server: int, local_gpus: int | None
) -> tuple[int, str]:
    """How many extraction server jobs (one model load each) share the shards, and why.

    ``local_gpus``: the GPUs of this machine when the jobs run here, None on a
    cluster (its GPU count is unknown to the workflow).
    """
    if configured is not None:
        servers, reason = configured, "set by extract.servers"
    elif gpus_per_server == 0:
        servers, reason = 1, "one on CPU, where the jobs share the cores"
    elif local_gpus is None:
        servers, reason = shards, (
            "one per shard: a cluster's GPU count is unknown here; set extract.servers "
            "to the number of nodes (or servers) that can run at once"
        )
    else:
        servers = max(1, local_gpus // gpus_per_server)
        reason = f"{local_gpus} GPUs here, {gpus_per_server} per server"
    return min(servers, shards), reason


def local_memory_mb(fraction: float = 0.9) -> int:
    """``fraction`` of this machine's memory in MB: the local profile's ``mem_mb`` cap."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4096
    return int(pages * fraction / 2**20)
