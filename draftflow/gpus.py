"""GPU placement for jobs that share one machine.

Snakemake's ``resources: gpu=k`` only caps how many GPUs the running jobs ask
for in total; it assigns no devices and never sets ``CUDA_VISIBLE_DEVICES``.
:func:`claim_gpus` does: it takes ``k`` devices that no concurrent job holds
(one ``fcntl.flock`` lock file per device), sets ``CUDA_VISIBLE_DEVICES`` to
them for the block (so a vLLM server or torchrun started inside inherits
them) and gives them back on exit. The kernel drops the locks when the
process dies, so a killed or crashed job never leaves a device taken.

Which devices exist, first match wins:

1. ``devices=`` (a count or a list of ids, e.g. from the config);
2. inside a SLURM job: ``CUDA_VISIBLE_DEVICES`` as the scheduler set it
   (else ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``): the allocation is respected,
   and the locks live in a folder of that job's own, so jobs of different
   allocations never wait on each other;
3. ``DRAFTFLOW_GPUS``: device ids, comma-separated (``0,1,2,3``); ``none``
   for none. It fakes a device list on a machine without GPUs;
4. ``CUDA_VISIBLE_DEVICES`` set outside SLURM: the devices you left visible;
5. the NVIDIA driver: ``/proc/driver/nvidia/gpus/*``, else ``nvidia-smi -L``.

Locks live in ``DRAFTFLOW_GPU_LOCK_DIR`` (default ``<tmp>/draftflow-gpus``),
machine-wide, so separate Snakemake runs on one machine share the devices too.

The command line does the same for shell commands::

    python -m draftflow.gpus run -n 2 -- vllm serve ...   # claim 2, exec the command
    python -m draftflow.gpus list                          # devices and who holds them
    python -m draftflow.gpus count                         # how many devices
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path

ENV_DEVICES = "DRAFTFLOW_GPUS"
ENV_LOCK_DIR = "DRAFTFLOW_GPU_LOCK_DIR"
CUDA = "CUDA_VISIBLE_DEVICES"
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


class GpuClaimError(RuntimeError):
    """The devices a job asks for cannot be had."""


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _in_slurm_job(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def _nvidia_smi(*args: str) -> str:
    """What ``nvidia-smi ARGS`` prints; empty without it or where it fails."""
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _nvidia_devices() -> list[str]:
    if NVIDIA_PROC.is_dir():
        count = sum(1 for _ in NVIDIA_PROC.iterdir())
        if count:
            return [str(i) for i in range(count)]
    return [str(i) for i, _ in enumerate(re.findall(r"^GPU \d+:", _nvidia_smi("-L"), re.MULTILINE))]


def local_gpu_memory_bytes() -> int | None:
    """The smallest memory of this machine's NVIDIA GPUs (``nvidia-smi``), None without them."""
    listing = _nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
    mib = [int(value) for value in re.findall(r"^\s*(\d+)", listing, re.MULTILINE)]
    return min(mib) * 1024**2 if mib else None


def device_source(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """The device ids jobs on this machine (or in this SLURM job) may use, and where they came from."""
    environ = os.environ if environ is None else environ
    if _in_slurm_job(environ):
        for name in (CUDA, "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
            if name in environ:
                return _split(environ[name]), f"SLURM job {environ['SLURM_JOB_ID']} ({name})"
    if ENV_DEVICES in environ:
        value = environ[ENV_DEVICES].strip()
        return ([] if value.lower() in ("", "none") else _split(value)), ENV_DEVICES
    if CUDA in environ:
        return _split(environ[CUDA]), CUDA
    return _nvidia_devices(), "NVIDIA driver"


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str]:
    """The device ids :func:`claim_gpus` chooses from (see the module docstring)."""
    return device_source(environ)[0]


def local_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """How many GPUs jobs here may use: the local profile's ``resources: gpu`` cap."""
    return len(visible_devices(environ))


def default_lock_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = Path(environ.get(ENV_LOCK_DIR) or Path(tempfile.gettempdir()) / "draftflow-gpus")
    if _in_slurm_job(environ):
        # ids inside an allocation are the allocation's own (cgroups renumber
        # them from 0): never compare them across jobs
        return base / f"slurm-{environ['SLURM_JOB_ID']}"
    return base


def _lock_path(lock_dir: Path, device: str) -> Path:
    return lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}.lock"


def _make_dir(path: Path) -> None:
    """A lock folder every user of the machine can add files to (like /tmp)."""
    for folder in reversed([path, *path.parents]):
        if folder.exists():
            continue
        try:
            folder.mkdir()
            os.chmod(folder, 0o1777)
        except FileExistsError:
            pass


def _open_lock(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's file: a read-only fd locks just as well
        return os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)
    return fd


def _write_holder(fd: int, device: str) -> None:
    holder = {
        "device": device,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(sys.argv)[:300],
    }
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)


def _holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


def _try_lock(path: Path) -> int | None:
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _release(held: list[tuple[str, int]]) -> None:
    for _, fd in held:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    held.clear()


def _acquire(devices: Sequence[str], count: int, lock_dir: Path) -> list[tuple[str, int]]:
    """``count`` free devices, all or none, or an empty list."""
    held: list[tuple[str, int]] = []
    # one scan at a time, so two jobs never each hold part of what both need
    guard = _open_lock(lock_dir / "scan.lock")
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for device in devices:
            fd = _try_lock(_lock_path(lock_dir, device))
            if fd is not None:
                held.append((device, fd))
                if len(held) == count:
                    for device_id, lock_fd in held:
                        _write_holder(lock_fd, device_id)
                    return held
        _release(held)
        return []
    finally:
        os.close(guard)


def holders(devices: Sequence[str] | None = None, lock_dir: Path | None = None) -> dict[str, dict | None]:
    """Who holds each device now (``None``: free)."""
    devices = visible_devices() if devices is None else list(devices)
    lock_dir = default_lock_dir() if lock_dir is None else Path(lock_dir)
    status: dict[str, dict | None] = {}
    if not lock_dir.is_dir():
        return {device: None for device in devices}
    guard = _open_lock(lock_dir / "scan.lock")
    fcntl.flock(guard, fcntl.LOCK_EX)
    try:
        for device in devices:
            status[device] = _held_by(lock_dir, device)
    finally:
        os.close(guard)
    return status


def _held_by(lock_dir: Path, device: str) -> dict | None:
    path = _lock_path(lock_dir, device)
    if not path.exists():
        return None
    fd = _try_lock(path)
    if fd is None:
        return _holder(path) or {"device": device}
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


def _resolve(devices: int | Sequence[str] | None, environ: Mapping[str, str]) -> tuple[list[str], str]:
    if devices is None:
        return device_source(environ)
    if isinstance(devices, int):
        return [str(i) for i in range(devices)], "devices argument"
    return [str(d) for d in devices], "devices argument"


def _claim(
    count: int,
    devices: int | Sequence[str] | None,
    lock_dir: str | Path | None,
    timeout_s: float | None,
    poll_s: float,
    environ: Mapping[str, str],
) -> list[tuple[str, int]]:
    """Wait for ``count`` free devices; returns (id, locked fd) pairs."""
    pool, source = _resolve(devices, environ)
    if count > len(pool):
        raise GpuClaimError(
            f"this job needs {count} GPU(s) but {len(pool)} are visible "
            f"(from {source}: {pool}). On a machine without GPUs use a config with "
            f"device: cpu, or set {ENV_DEVICES}=0,1,... to fake a device list."
        )
    directory = default_lock_dir(environ) if lock_dir is None else Path(lock_dir)
    _make_dir(directory)
    started = said = time.monotonic()
    while not (held := _acquire(pool, count, directory)):
        now = time.monotonic()
        if timeout_s is not None and now - started >= timeout_s:
            raise GpuClaimError(
                f"no {count} free GPU(s) among {pool} after {timeout_s:g}s; "
                f"held: {holders(pool, directory)}"
            )
        if now - said >= 60:
            said = now
            print(
                f"draftflow.gpus: waiting {now - started:.0f}s for {count} of {pool}; "
                f"held: {holders(pool, directory)}",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(poll_s)
    return held


def _check_count(count: object) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"GPU count must be an integer >= 0, got {count!r}")


@contextlib.contextmanager
def claim_gpus(
    count: int,
    *,
    devices: int | Sequence[str] | None = None,
    lock_dir: str | Path | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    environ: MutableMapping[str, str] | None = None,
) -> Iterator[list[str]]:
    """Hold ``count`` devices no concurrent job holds; yields their ids.

    ``CUDA_VISIBLE_DEVICES`` is set to them inside the block and restored
    after, also on an exception; the locks go with the process if it dies.
    ``count`` 0 holds nothing and leaves the environment alone. Waits (forever
    by default, saying so every minute) while other jobs hold the devices;
    fails at once when fewer devices exist than asked for. The environment is
    the process's: one claim per process (a job's script), not per thread.
    """
    environ = os.environ if environ is None else environ
    _check_count(count)
    if count == 0:
        yield []
        return
    held = _claim(count, devices, lock_dir, timeout_s, poll_s, environ)
    ids = [device for device, _ in held]
    previous = environ.get(CUDA)
    environ[CUDA] = ",".join(ids)
    try:
        yield ids
    finally:
        if previous is None:
            environ.pop(CUDA, None)
        else:
            environ[CUDA] = previous
        _release(held)


def main(argv: Sequence[str] | None = None, prog: str = "python -m draftflow.gpus") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="claim GPUs, then exec COMMAND with CUDA_VISIBLE_DEVICES set")
    run.add_argument("-n", "--count", type=int, required=True)
    run.add_argument("--timeout", type=float, default=None, help="seconds to wait for free devices")
    run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="the devices and who holds them (JSON)")
    sub.add_parser("count", help="how many devices jobs here may use")
    args = parser.parse_args(argv)

    if args.command == "count":
        print(local_gpu_count())
        return 0
    if args.command == "list":
        devices, source = device_source()
        print(json.dumps({"source": source, "lock_dir": str(default_lock_dir()), "devices": holders(devices)}, indent=2))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run: give a command after --")
    _check_count(args.count)
    if args.count:
        held = _claim(args.count, None, None, args.timeout, 0.5, os.environ)
        # the command inherits the locked fds: the devices stay held until it exits
        for _, fd in held:
            os.set_inheritable(fd, True)
        os.environ[CUDA] = ",".join(device for device, _ in held)
    os.execvp(command[0], command)
    return 127  # not reached

if __name__ == "__main__":
    sys.exit(main())
