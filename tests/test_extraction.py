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

from draftflow.extract import layout
from draftflow.extract.hidden_states import (
    STORAGES,
    read_hidden_states,
    read_token_ids,
    to_storage,
    write_sample,
)
from draftflow.extract.layout import (
    HEADER_BYTES_MAX,
    ExtractionSettings,
    Sample,
    WrittenFile,
    hidden_state_bytes,
    shard_of,
    token_digest,
)
from draftflow.extract.shards import ShardJournal, plan_extraction, run_shard
from draftflow.extract.transformers_backend import (
    batches_by_token_budget,
    transformers_extractor,
)
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
        resolve_layer_ids([2, 3, 3], 6)


def test_the_default_layer_ids_are_distinct_and_ordered_for_every_layer_count_from_4():
    assert resolve_layer_ids(None, 32) == [2, 16, 29, 32]  # vLLM's and speculators' default
    for num_layers in range(4, 200):
        aux = resolve_layer_ids(None, num_layers)[:-1]
        assert aux == sorted(set(aux)) and len(aux) == 3 and 0 < aux[0] and aux[-1] < num_layers, (num_layers, aux)
    assert resolve_layer_ids(None, 6) == [1, 3, 5, 6]
    with pytest.raises(ValueError, match=r"The target has 3 layers: too few .* Set extract.layer_ids .* e\.g\. \[0, 1, 2\]"):
        resolve_layer_ids(None, 3)


def test_shard_assignment_is_stable_as_samples_grow():
    ids = [f"sample-{i}" for i in range(1000)]
    shards = {i: shard_of(i, 16) for i in ids}
    assert {shard_of(i, 16) for i in ids[:100]} == set(range(16))
    assert all(shard_of(i, 16) == shards[i] for i in ids[:500])


def test_token_budget_batches_cover_every_sample_once():
    samples = make_samples(50)
    packed, padded = list(batches_by_token_budget(samples, 200)), list(batches_by_token_budget(samples, 200, packed=False))
    for batches in (packed, padded):
        assert sorted(s.index for b in batches for s in b) == list(range(50))
    assert all(sum(len(s.token_ids) for s in b) <= 200 or len(b) == 1 for b in packed)
    assert all(len(b) * max(len(s.token_ids) for s in b) <= 200 or len(b) == 1 for b in padded)
    assert len(packed) < len(padded)


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
    plan = plan_extraction(samples, 1, 1, settings, 64)
    actual = sum(r.bytes for r in first)
    assert actual <= plan["bytes"] and plan["bytes"] - actual <= 256 * len(samples)
    assert sorted(p.name for p in shard_dir.glob("hs_*")) == sorted(layout.file_name(s.sample_id) for s in samples)
    damaged = shard_dir / layout.file_name("s3")
    damaged.write_bytes(damaged.read_bytes()[:100])
    layout.temp_file(shard_dir / layout.file_name("s5")).write_bytes(b"partial")
    untouched = (shard_dir / layout.file_name("s1")).stat().st_mtime_ns

    second = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, open_extractor)
    redone = [r.sample_id for r, s in zip(first, second) if r.sha256 != s.sha256]
    assert redone in ([], ["s3"])  # a batch of one may round differently from the first batch
    assert damaged.stat().st_size == second[3].bytes == first[3].bytes
    assert (shard_dir / layout.file_name("s1")).stat().st_mtime_ns == untouched
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
        record = write_sample(tmp_path, "s0", states, torch.zeros(tokens, dtype=torch.int64))
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
    record = write_sample(tmp_path, "s7", stored, token_ids)
    written = (tmp_path / layout.file_name("s7")).read_bytes()
    tensors = {"hidden_states": states} if storage == "full" else {"hidden_states": stored.values, SCALES_KEY: stored.scales}
    assert written == save({**tensors, "token_ids": token_ids})
    assert record.bytes == len(written) and record.sha256 == hashlib.sha256(written).hexdigest()
    assert record.sample_id == "s7" and record.tokens == 37 and record.token_digest == token_digest(token_ids.tolist())


def test_speculators_fp8_reader_takes_the_files_and_each_value_is_within_fp8_rounding(tmp_path):
    """Through a training view's link: the file is named by sample id, speculators reads it by row."""
    states = torch.randn(37, 4, 64) * torch.logspace(-2, 2, 4).reshape(1, 4, 1)  # layers of very different scales
    (tmp_path / "shard-0").mkdir()
    write_sample(tmp_path / "shard-0", "s-abc", to_storage(states, "fp8"), torch.arange(37))
    view = tmp_path / "view"
    view.mkdir()
    (view / layout.view_file_name(3)).symlink_to(tmp_path / "shard-0" / layout.file_name("s-abc"))
    read = FP8Transfer(view, dequantize_dtype=torch.float32).get_cached(3)
    assert set(read) == {"hidden_states", "token_ids"} and read["hidden_states"].dtype == torch.float32
    assert read["token_ids"].tolist() == list(range(37))
    assert torch.equal(read["hidden_states"], read_hidden_states(tmp_path / "shard-0" / layout.file_name("s-abc")))
    scale = states.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    error = (read["hidden_states"] - states).abs()
    # normal fp8 values round within 2**-4 of themselves; subnormals within half their step
    assert (error <= torch.maximum(states.abs() * 2**-4, scale * 2**-10) * 1.0001).all()


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
    journaled = set(ShardJournal(shard_dir, settings).completed(samples))
    assert {layout.file_sample_id(p.name) for p in shard_dir.glob("hs_*.safetensors")} == journaled
    assert len(journaled) == 5
    assert json.loads((tmp_path / "hb.json").read_text())["status"] == "failed"

    def open_extractor():
        return transformers_extractor(str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=256)

    resumed = run_shard(samples, 0, shard_dir, tmp_path / "hb.json", settings, open_extractor, writers=4)
    assert [r.sample_id for r in resumed] == [s.sample_id for s in samples]
    threaded = run_shard(samples, 0, tmp_path / "threaded", tmp_path / "hb2.json", settings, open_extractor, writers=4)
    serial = run_shard(samples, 0, tmp_path / "serial", tmp_path / "hb3.json", settings, open_extractor, writers=0)
    assert [r.sha256 for r in threaded] == [r.sha256 for r in serial]


# -- files named by sample id: rows may move, tokens may change -----------------

FAKE_SETTINGS = ExtractionSettings("fake", (1, 2), "float32", "fp")


class FakeExtractor:
    """States computed from the token ids alone (2 slots x 4 values a token); counts
    the model loads and records which samples it was asked for."""

    def __init__(self):
        self.asked: list[str] = []
        self.loads = 0

    def states(self, token_ids):
        tokens = torch.tensor(token_ids, dtype=torch.float32)
        return tokens.reshape(-1, 1, 1) * torch.arange(1, 9, dtype=torch.float32).reshape(1, 2, 4)

    @contextlib.contextmanager
    def __call__(self):
        self.loads += 1

        def extract(todo):
            for sample in todo:
                self.asked.append(sample.sample_id)
                yield sample, self.states(sample.token_ids)

        yield extract


def fake_run(samples, shard_dir, extractor, writers=2):
    return run_shard(samples, 0, shard_dir, shard_dir.parent / "hb.json", FAKE_SETTINGS, extractor, writers=writers)


def assert_each_file_holds_its_sample(shard_dir, samples, extractor):
    for sample in samples:
        path = shard_dir / layout.file_name(sample.sample_id)
        assert read_token_ids(path) == sample.token_ids
        assert torch.equal(read_hidden_states(path), extractor.states(sample.token_ids))


def test_a_rerun_after_rows_moved_reuses_every_file_and_extracts_only_the_new_samples(tmp_path, capsys):
    shard_dir = tmp_path / "shard-0"
    old = make_samples(6)
    first_extractor = FakeExtractor()
    first = fake_run(old, shard_dir, first_extractor)
    assert first_extractor.asked == [s.sample_id for s in old]
    mtimes = {s.sample_id: (shard_dir / layout.file_name(s.sample_id)).stat().st_mtime_ns for s in old}

    # three new samples inserted before the old ones: every old sample's row moves by 3
    new = [Sample(i, f"new{i}", [7 + i] * (4 + i)) for i in range(3)]
    moved = new + [Sample(s.index + 3, s.sample_id, s.token_ids) for s in old]
    capsys.readouterr()
    extractor = FakeExtractor()
    records = fake_run(moved, shard_dir, extractor)
    assert "shard 0: 6 of 9 samples already on disk, 3 to extract; 0 file(s) that no sample claims now removed" in (
        capsys.readouterr().out
    )
    assert extractor.asked == ["new0", "new1", "new2"] and extractor.loads == 1
    assert [r.sample_id for r in records] == [s.sample_id for s in moved]
    assert records[3:] == first  # the old samples' records, kept as they were
    assert {s.sample_id: (shard_dir / layout.file_name(s.sample_id)).stat().st_mtime_ns for s in old} == mtimes
    assert sorted(p.name for p in shard_dir.glob("hs_*")) == sorted(layout.file_name(s.sample_id) for s in moved)
    assert_each_file_holds_its_sample(shard_dir, moved, extractor)

    again = FakeExtractor()  # nothing left: no model load at all
    assert fake_run(moved, shard_dir, again) == records and again.loads == 0 and again.asked == []

    # a sample gone from the shard: its file is the only one removed
    capsys.readouterr()
    fewer = [s for s in moved if s.sample_id != "s2"]
    fake_run(fewer, shard_dir, FakeExtractor())
    assert "8 of 8 samples already on disk, 0 to extract; 1 file(s) that no sample claims now removed" in (
        capsys.readouterr().out
    )
    assert not (shard_dir / layout.file_name("s2")).exists()
    assert set(ShardJournal(shard_dir, FAKE_SETTINGS).completed(moved)) == {s.sample_id for s in fewer}


def test_changed_tokens_under_the_same_id_and_another_samples_file_under_its_name_are_redone(tmp_path, capsys):
    shard_dir = tmp_path / "shard-0"
    samples = [
        Sample(0, "a", [1, 2, 3, 4, 5]),
        Sample(1, "b", [9, 8, 7, 6, 5]),  # as many tokens as a: its file has a's size
        Sample(2, "c", [11, 12, 13]),
        Sample(3, "d", [20, 21, 22, 23]),
    ]
    fake_run(samples, shard_dir, FakeExtractor())
    path = {s.sample_id: shard_dir / layout.file_name(s.sample_id) for s in samples}
    # c's tokens changed upstream (same id, same length: same file size)
    edited = [*samples[:2], Sample(2, "c", [31, 32, 33]), samples[3]]
    # b's file planted under a's name: a's journal record, a's size, b's token ids
    path["a"].write_bytes(path["b"].read_bytes())
    _, journaled = layout.read_journal(layout.journal_path(shard_dir))
    assert journaled["a"].token_digest == samples[0].token_digest and path["a"].stat().st_size == journaled["a"].bytes
    assert set(ShardJournal(shard_dir, FAKE_SETTINGS).completed(edited)) == {"b", "d"}
    untouched = {name: path[name].stat().st_mtime_ns for name in ("b", "d")}

    capsys.readouterr()
    extractor = FakeExtractor()
    records = fake_run(edited, shard_dir, extractor)
    assert "2 of 4 samples already on disk, 2 to extract" in capsys.readouterr().out
    assert extractor.asked == ["a", "c"]
    assert_each_file_holds_its_sample(shard_dir, edited, extractor)
    assert {name: path[name].stat().st_mtime_ns for name in ("b", "d")} == untouched
    assert [r.token_digest for r in records] == [s.token_digest for s in edited]
    assert records[2].token_digest != samples[2].token_digest
    assert set(ShardJournal(shard_dir, FAKE_SETTINGS).completed(edited)) == {"a", "b", "c", "d"}
    assert ShardJournal(shard_dir, FAKE_SETTINGS).completed(samples).keys() == {"a", "b", "d"}  # c: the old tokens


def test_a_shard_of_row_named_files_and_index_records_is_extracted_again(tmp_path, capsys):
    """The layout before files were named by sample id: its journal records (with an
    index) are skipped and its files, named by row, removed."""
    shard_dir = tmp_path / "shard-0"
    shard_dir.mkdir()
    samples = make_samples(3)
    extractor = FakeExtractor()
    old_records = []
    for sample in samples:
        record = write_sample(shard_dir, sample.sample_id, extractor.states(sample.token_ids), torch.tensor(sample.token_ids))
        (shard_dir / layout.file_name(sample.sample_id)).rename(shard_dir / layout.view_file_name(sample.index))
        old_records.append({"index": sample.index, "sample_id": sample.sample_id, "tokens": record.tokens,
                            "bytes": record.bytes, "sha256": record.sha256})  # fmt: skip
    lines = [{"settings_key": FAKE_SETTINGS.key()}, *old_records]
    layout.journal_path(shard_dir).write_text("".join(layout.journal_line(line) + "\n" for line in lines))
    assert ShardJournal(shard_dir, FAKE_SETTINGS).completed(samples) == {}

    capsys.readouterr()
    records = fake_run(samples, shard_dir, extractor)
    assert "0 of 3 samples already on disk, 3 to extract; 3 file(s) that no sample claims now removed" in (
        capsys.readouterr().out
    )
    assert extractor.asked == [s.sample_id for s in samples]
    assert sorted(p.name for p in shard_dir.glob("hs_*")) == sorted(layout.file_name(s.sample_id) for s in samples)
    assert layout.read_journal(layout.journal_path(shard_dir)) == (
        FAKE_SETTINGS.key(), {r.sample_id: r for r in records}
    )
    assert all(isinstance(r, WrittenFile) for r in records)
