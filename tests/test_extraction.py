"""Extraction pieces on a tiny random Llama: layer semantics, batching, resume."""

import contextlib
import hashlib
import itertools
import json

import pytest
import torch
from hs_connectors import FP8Transfer
from hs_connectors.fp8_utils import SCALES_KEY
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.extract.transformers_backend import batches_by_token_budget, transformers_extractor
from draftflow.extract.hidden_states import STORAGES, read_hidden_states, to_storage, write_sample
from draftflow.extract.layout import HEADER_BYTES_MAX, Sample, hidden_state_bytes
from draftflow.extract.shards import ExtractionSettings, ShardJournal, plan_extraction, run_shard, shard_of
from draftflow.layers import resolve_layer_ids

LAYERS = 8


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_samples(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        Sample(i, f"s{i}", torch.randint(0, 300, (int(torch.randint(5, 60, (1,), generator=generator)),), generator=generator).tolist())
        for i in range(count)
    ]


def test_layer_ids_default_and_validation():
    assert resolve_layer_ids(None, 8) == [2, 4, 5, 8]
    assert resolve_layer_ids([1, 3], 8) == [1, 3, 8]
    with pytest.raises(ValueError, match=r"0\.\.7"):
        resolve_layer_ids([2, 9], 8)
    with pytest.raises(ValueError, match="distinct"):
        resolve_layer_ids(None, 6)


def test_shard_assignment_is_stable_as_samples_grow():
    ids = [f"sample-{i}" for i in range(1000)]
    shards = {i: shard_of(i, 16) for i in ids}
    assert {shard_of(i, 16) for i in ids[:100]} == set(range(16))
    assert all(shard_of(i, 16) == shards[i] for i in ids[:500])


def test_token_budget_batches_cover_every_sample_once():
    samples = make_samples(50)
    batches = list(batches_by_token_budget(samples, 200))
    assert sorted(s.index for b in batches for s in b) == list(range(50))
    assert all(len(b) * max(len(s.token_ids) for s in b) <= 200 or len(b) == 1 for b in batches)


def test_slots_match_hf_hidden_states_and_last_is_before_the_norm(tiny_target):
    layer_ids = resolve_layer_ids(None, LAYERS)
    samples = make_samples(6)
    model = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    pre_norm = {}
    model.model.norm.register_forward_hook(lambda m, args, out: pre_norm.update(x=args[0]))
    with transformers_extractor(str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=128) as extract:
        extracted = {sample.index: states for sample, states in extract(samples)}
    for sample in samples:
        with torch.no_grad():
            reference = model(torch.tensor([sample.token_ids]), output_hidden_states=True).hidden_states
        states = extracted[sample.index]
        assert states.shape == (len(sample.token_ids), len(layer_ids), 64)
        for slot, k in enumerate(layer_ids[:-1]):
            torch.testing.assert_close(states[:, slot], reference[k][0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(states[:, -1], pre_norm["x"][0], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(states[:, -1], reference[LAYERS][0], atol=1e-3)


def test_shard_resumes_and_redoes_only_damaged_files(tiny_target, tmp_path):
    layer_ids = resolve_layer_ids(None, LAYERS)
    samples = make_samples(8)
    settings = ExtractionSettings("transformers", tuple(layer_ids), "float32", "fp")

    def open_extractor():
        return transformers_extractor(str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=256)

    shard_dir = tmp_path / "shard-0"
    first = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, open_extractor)
    plan = plan_extraction(samples, 1, 1, layer_ids, 64, "float32", "full")
    actual = sum(r.bytes for r in first)
    assert actual <= plan["bytes"] and plan["bytes"] - actual <= 256 * len(samples)
    damaged = shard_dir / "hs_3.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    (shard_dir / ".hs_5.safetensors.tmp").write_bytes(b"partial")
    untouched = (shard_dir / "hs_1.safetensors").stat().st_mtime_ns

    second = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, open_extractor)
    redone = [r.index for r, s in zip(first, second) if r.sha256 != s.sha256]
    assert redone in ([], [3])  # a batch of one may round differently from the first batch
    assert (shard_dir / "hs_1.safetensors").stat().st_mtime_ns == untouched
    assert not list(shard_dir.glob("*.tmp"))
    payload = load_file(damaged)
    assert payload["token_ids"].tolist() == samples[3].token_ids
    heartbeat = json.loads((tmp_path / "hb.json").read_text())
    assert heartbeat["status"] == "done" and heartbeat["samples_done"] == len(samples)

    other = ExtractionSettings("transformers", (1, 2, 3, LAYERS), "float32", "fp")
    third = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", other, lambda: transformers_extractor(
        str(tiny_target), [1, 2, 3, LAYERS], dtype="float32", device="cpu", token_budget=256))
    assert [r.sha256 for r in third] != [r.sha256 for r in first]


@pytest.mark.parametrize(("dtype", "storage"), [("float32", "full"), ("bfloat16", "full"), ("bfloat16", "fp8")])
def test_hidden_state_bytes_is_exact_up_to_the_header(tmp_path, dtype, storage):
    for tokens, layers, hidden in ((37, 4, 64), (3000, 4, 1024)):
        states = to_storage(torch.ones(tokens, layers, hidden, dtype=getattr(torch, dtype)), storage)
        record = write_sample(tmp_path, 0, "s0", states, torch.zeros(tokens, dtype=torch.int64))
        assert 0 <= hidden_state_bytes(tokens, layers, hidden, dtype, storage) - record.bytes <= HEADER_BYTES_MAX


def test_fp8_storage_is_half_of_bfloat16_and_the_scale_per_token():
    for layers, hidden in ((4, 128), (4, 4096)):  # the demo's shape; an 8B target's
        full, fp8 = (hidden_state_bytes(1000, layers, hidden, "bfloat16", storage) - HEADER_BYTES_MAX for storage in STORAGES)
        assert fp8 == 1000 * (layers * hidden + 4 + 8) and fp8 / full <= 0.52


@pytest.mark.parametrize("storage", ["full", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_files_are_the_bytes_safetensors_writes(tmp_path, dtype, storage):
    from safetensors.torch import save

    states, token_ids = torch.randn(37, 4, 64).to(dtype), torch.randint(0, 300, (37,))
    stored = to_storage(states, storage)
    record = write_sample(tmp_path, 7, "s7", stored, token_ids)
    written = (tmp_path / "hs_7.safetensors").read_bytes()
    tensors = {"hidden_states": states} if storage == "full" else {"hidden_states": stored.values, SCALES_KEY: stored.scales}
    assert written == save({**tensors, "token_ids": token_ids})
    assert record.bytes == len(written) and record.sha256 == hashlib.sha256(written).hexdigest()


def test_speculators_fp8_reader_takes_the_files_and_each_value_is_within_fp8_rounding(tmp_path):
    states = torch.randn(37, 4, 64) * torch.logspace(-2, 2, 4).reshape(1, 4, 1)  # layers of very different scales
    write_sample(tmp_path, 3, "s3", to_storage(states, "fp8"), torch.arange(37))
    read = FP8Transfer(tmp_path, dequantize_dtype=torch.float32).get_cached(3)
    assert set(read) == {"hidden_states", "token_ids"} and read["hidden_states"].dtype == torch.float32
    assert torch.equal(read["hidden_states"], read_hidden_states(tmp_path / "hs_3.safetensors"))
    scale = states.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    error = (read["hidden_states"] - states).abs()
    # normal fp8 values round within 2**-4 of themselves; subnormals within half their step
    assert (error <= torch.maximum(states.abs() * 2**-4, scale * 2**-10) * 1.0001).all()


def test_full_storage_keeps_the_journal_key_it_had_before_fp8():
    full = ExtractionSettings("vllm", (2, 4, 8), "bfloat16", "fp")
    before = hashlib.sha256(json.dumps({"backend": "vllm", "layer_ids": [2, 4, 8], "dtype": "bfloat16",
                                        "target_fingerprint": "fp"}).encode()).hexdigest()[:16]  # fmt: skip
    assert full.key() == ExtractionSettings("vllm", (2, 4, 8), "bfloat16", "fp", "full").key() == before
    assert ExtractionSettings("vllm", (2, 4, 8), "bfloat16", "fp", "fp8").key() != before


class ExtractorFails(RuntimeError):
    pass


def test_threaded_writes_journal_exactly_the_files_on_disk_when_extraction_fails(tiny_target, tmp_path):
    """Writer threads may finish out of order; the journal must still list exactly the renamed files."""
    layer_ids = resolve_layer_ids(None, LAYERS)
    samples = make_samples(12)
    settings = ExtractionSettings("transformers", tuple(layer_ids), "float32", "fp")

    @contextlib.contextmanager
    def failing_after(count):
        with transformers_extractor(str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=256) as extract:
            def extract_then_fail(todo):
                yield from itertools.islice(extract(todo), count)
                raise ExtractorFails("target died")

            yield extract_then_fail

    shard_dir = tmp_path / "shard-0"
    with pytest.raises(ExtractorFails):
        run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, lambda: failing_after(5), writers=4)
    journaled = set(ShardJournal(shard_dir, settings).completed())
    assert {int(p.stem[3:]) for p in shard_dir.glob("hs_*.safetensors")} == journaled and len(journaled) == 5
    assert json.loads((tmp_path / "hb.json").read_text())["status"] == "failed"

    def open_extractor():
        return transformers_extractor(str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=256)

    resumed = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, open_extractor, writers=4)
    assert [r.index for r in resumed] == [s.index for s in samples]
    threaded = run_shard(samples, 0, tmp_path / "threaded", tmp_path / "hb2.json", settings, open_extractor, writers=4)
    serial = run_shard(samples, 0, tmp_path / "serial", tmp_path / "hb3.json", settings, open_extractor, writers=0)
    assert [r.sha256 for r in threaded] == [r.sha256 for r in serial]
