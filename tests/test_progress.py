"""The progress check on real partial extractions of a tiny random Llama."""

import contextlib
import io
import json
import math
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from draftflow.costs import drafter_parameters
from draftflow.extract import layout
from draftflow.extract.layout import (
    HEADER_BYTES_MAX,
    ExtractionSettings,
    Sample,
    shard_samples,
)
from draftflow.extract.shards import plan_extraction, run_shard, shard_manifest
from draftflow.extract.transformers_backend import transformers_extractor
from draftflow.io import write_json
from draftflow.layers import resolve_layer_ids
from draftflow.progress import (
    FAILED_SHARD,
    ON_TRACK,
    STALLED,
    WILL_NOT_FIT,
    Options,
    check,
    render_table,
    watch,
)
from draftflow.target_model import read_target_model
from draftflow.units import fmt_bytes, parse_size
from tests.conftest import DRAFTFLOW

LAYERS, HIDDEN = 4, 32
LAYER_IDS = resolve_layer_ids([1, 2], LAYERS)
SETTINGS = ExtractionSettings("transformers", tuple(LAYER_IDS), "float32", "test")


class Stopped(Exception):
    """Stands in for a shard job stopped mid-way."""


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@dataclass
class Run:
    """A run directory whose shards are extracted for real, one call at a time."""

    hs_dir: Path
    samples: list[Sample]
    num_shards: int
    target: Path

    @classmethod
    def plan(cls, run_dir: Path, lengths: list[int], num_shards: int, target: Path) -> "Run":
        generator = torch.Generator().manual_seed(1)
        samples = [
            Sample(i, f"s{i}", torch.randint(0, 300, (n,), generator=generator).tolist())
            for i, n in enumerate(lengths)
        ]
        plan = plan_extraction(samples, num_shards, num_shards, SETTINGS, HIDDEN)
        write_json(run_dir / "hidden_states/plan.json", plan | {"disk": {}})
        return cls(run_dir / "hidden_states", samples, num_shards, target)

    def extract(self, shard: int, stop_after: int | None = None, at_stop=lambda: None) -> None:
        """Run one shard; with ``stop_after``, stop it once that many files are written."""
        settings = SETTINGS

        @contextlib.contextmanager
        def open_extractor():
            with transformers_extractor(
                str(self.target), LAYER_IDS, dtype="float32", device="cpu", token_budget=512
            ) as extract:
                yield lambda todo: stopping(extract(todo), stop_after, at_stop)

        samples = shard_samples(self.samples, shard, self.num_shards)
        paths = layout.shard_dir(self.hs_dir, shard), layout.heartbeat_path(self.hs_dir, shard)
        try:
            records = run_shard(samples, shard, *paths, settings, open_extractor, writers=0)  # stops at exact counts
        except Stopped:
            return
        manifest = shard_manifest(shard, self.num_shards, records, settings, HIDDEN, str(self.target))
        write_json(layout.shard_manifest_path(self.hs_dir, shard), manifest)


def stopping(items, stop_after: int | None, at_stop):
    for count, item in enumerate(items):
        if count == stop_after:  # run_shard has written the `count` items before this one
            at_stop()
            raise Stopped
        yield item


def files_on_disk(shard_dir: Path) -> tuple[int, int, int]:
    """(files, tokens, bytes) of the finished files, read from the files themselves."""
    names = [p.name for p in shard_dir.iterdir()] if shard_dir.is_dir() else []
    paths = sorted(shard_dir / name for name in names if layout.file_sample_id(name) is not None)
    tokens = 0
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            tokens += f.get_slice("token_ids").get_shape()[0]
    return len(paths), tokens, sum(p.stat().st_size for p in paths)


@pytest.fixture(scope="module")
def partial(tiny_target, tmp_path_factory):
    """Shard 0 done, shard 1 stopped half-way (checked while it ran), shard 2 not started."""
    lengths = torch.randint(5, 120, (36,), generator=torch.Generator().manual_seed(0)).tolist()
    run = Run.plan(tmp_path_factory.mktemp("partial"), lengths, 3, tiny_target)
    run.extract(0)
    snapshots = {}

    def while_running():
        snapshots["now"] = check(run.hs_dir)
        snapshots["files"] = [files_on_disk(layout.shard_dir(run.hs_dir, k)) for k in range(3)]
        snapshots["an hour later"] = check(run.hs_dir, now=time.time() + 3600)
        shutil.copytree(run.hs_dir, snapshots.setdefault("copy", tmp_path_factory.mktemp("running") / "hidden_states"))

    half = len(shard_samples(run.samples, 1, 3)) // 2
    run.extract(1, stop_after=half, at_stop=while_running)
    return run, snapshots


@pytest.fixture(scope="module")
def finished(partial, tmp_path_factory):
    """A copy of the partial run (mtimes kept), resumed and finished."""
    run, _ = partial
    copy = tmp_path_factory.mktemp("finished") / "run"
    shutil.copytree(run.hs_dir.parent, copy)
    done = Run(copy / "hidden_states", run.samples, run.num_shards, run.target)
    for shard in (1, 2):
        done.extract(shard)
    return done


def test_counts_equal_the_files_on_disk_while_running_and_after_the_stop(partial):
    run, snapshots = partial
    running = snapshots["now"]
    assert [s.state for s in running.shards] == ["done", "running", "not started"]
    assert [(s.samples_done, s.tokens_done, s.bytes_done) for s in running.shards] == snapshots["files"]
    assert running.exit_code == ON_TRACK and running.rates.recent_tokens_per_s > 0
    assert running.eta.seconds > 0 and running.eta.pending_loads == 1  # shard 2 still loads its model

    stopped = check(run.hs_dir.parent)  # results/<run> works as well as its hidden_states/
    assert [s.state for s in stopped.shards] == ["done", "failed", "not started"]
    assert stopped.shard_states == {"running": 0, "loading": 0, "done": 1, "not started": 1, "failed": 1}
    for shard in stopped.shards:
        assert (shard.samples_done, shard.tokens_done, shard.bytes_done) == files_on_disk(
            layout.shard_dir(run.hs_dir, shard.shard)
        )
    assert stopped.samples_done == sum(s.samples_done for s in stopped.shards) < stopped.samples_total == 36
    assert stopped.exit_code == FAILED_SHARD and "failed shard(s): 1" in stopped.problems[0]


def one_server_for_all_shards(hs_dir: Path) -> None:
    plan = json.loads((hs_dir / layout.PLAN).read_text())
    write_json(hs_dir / layout.PLAN, plan | {"servers": 1, "shards": [s | {"server": 0} for s in plan["shards"]]})


def test_model_loads_ahead_follow_server_jobs_not_shards(partial, tmp_path):
    """Shard 2 waits behind shard 1 in the same server job: no load ahead; once that job is killed, one."""
    run, snapshots = partial
    assert snapshots["now"].eta.pending_loads == 1  # three server jobs: shard 2's still loads
    running = snapshots["copy"]  # the files and heartbeats while shard 1 ran (this process: alive)
    one_server_for_all_shards(running)
    while_running = check(running)
    assert [s.state for s in while_running.shards] == ["done", "running", "not started"]
    assert while_running.eta.pending_loads == 0 and while_running.eta.loading_s == 0.0
    stopped = tmp_path / "hidden_states"
    shutil.copytree(run.hs_dir, stopped)  # shard 1's process is gone: its server job must load again
    one_server_for_all_shards(stopped)
    assert check(stopped).eta.pending_loads == 1
    assert check(run.hs_dir).eta.pending_loads == 2  # three server jobs: shard 1's and shard 2's


def test_a_silent_running_shard_is_reported_stalled(partial):
    _, snapshots = partial
    later = snapshots["an hour later"]
    assert later.stall.stalled and later.exit_code == STALLED
    assert "stalled: no shard has advanced for 1h00m" in render_table(later)


def test_a_killed_shard_whose_heartbeat_still_says_running_counts_as_failed(partial, tmp_path):
    run, _ = partial
    copy = tmp_path / "run"
    shutil.copytree(run.hs_dir.parent, copy)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names no process
    heartbeat_path = layout.heartbeat_path(copy / "hidden_states", 1)
    heartbeat = json.loads(heartbeat_path.read_text()) | {"status": "running", "pid": gone.pid}
    write_json(heartbeat_path, heartbeat)
    killed = check(copy)
    assert killed.shards[1].state == "failed" and f"process {gone.pid} is gone" in killed.shards[1].note
    assert killed.exit_code == FAILED_SHARD
    elsewhere = check(copy, Options(check_pids=False))  # --no-pid-check: shards on other machines
    assert elsewhere.shards[1].state == "running" and elsewhere.exit_code == ON_TRACK


def test_exact_projection_equals_the_final_size_and_the_linear_one_stands_beside_it(partial, finished):
    run, _ = partial
    stopped = check(run.hs_dir)
    final = sum(files_on_disk(layout.shard_dir(finished.hs_dir, k))[2] for k in range(3))
    remaining = stopped.samples_total - stopped.samples_done
    assert abs(stopped.size.projected_exact - final) <= HEADER_BYTES_MAX * remaining
    assert stopped.size.projected_linear != stopped.size.projected_exact
    linear = fmt_bytes(stopped.size.projected_linear)
    assert f"exact (each remaining sample's tokens), {linear} linear" in render_table(stopped)

    after = check(finished.hs_dir)
    assert after.complete and after.exit_code == ON_TRACK and after.eta.seconds == 0
    assert after.size.projected_exact == after.size.bytes_done == final
    assert after.rates.tokens_per_s > 0 and after.stall.stalled is False


def test_uneven_lengths_exact_projection_within_1_percent_at_15_percent(tiny_target, tmp_path):
    lengths = [
        round(math.exp(x))
        for x in torch.empty(60).uniform_(1.0, 6.3, generator=torch.Generator().manual_seed(2)).tolist()
    ]
    run = Run.plan(tmp_path, lengths, 1, tiny_target)
    early = {}
    run.extract(0, stop_after=9, at_stop=lambda: early.update(report=check(run.hs_dir)))  # 15% of 60 samples
    run.extract(0)
    final = files_on_disk(layout.shard_dir(run.hs_dir, 0))[2]
    size = early["report"].size
    assert early["report"].samples_done == 9
    assert abs(size.projected_exact / final - 1) < 0.01
    # the transformers backend batches by length, longest first: the linear projection overshoots
    assert size.projected_linear / final - 1 > 0.5


def test_a_file_counts_done_only_for_the_tokens_the_plan_has_for_its_sample(finished, tmp_path):
    """Files are named by sample id: a plan made after new samples were inserted before the
    old ones (every old row moved) counts all their files; a sample whose tokens changed
    upstream (another token digest in the plan) has its old file left undone."""
    copy = tmp_path / "hidden_states"
    shutil.copytree(finished.hs_dir, copy)
    plan = json.loads((copy / layout.PLAN).read_text())
    before = check(copy)
    assert before.samples_done == before.samples_total == 36 and not any(s.unjournaled_files for s in before.shards)

    new = [Sample(i, f"new{i}", [5 + i] * 10) for i in range(6)]
    moved = new + [Sample(s.index + len(new), s.sample_id, s.token_ids) for s in finished.samples]
    write_json(copy / layout.PLAN, plan_extraction(moved, 3, 3, SETTINGS, HIDDEN) | {"disk": {}})
    grown = check(copy)
    assert (grown.samples_done, grown.samples_total) == (36, 42) and grown.tokens_done == before.tokens_done
    assert [s.bytes_done for s in grown.shards] == [s.bytes_done for s in before.shards]

    sample_id, tokens, digest = plan["shards"][0]["samples"][0]
    assert layout.shard_dir(copy, 0).joinpath(layout.file_name(sample_id)).exists()
    edited = [[sample_id, tokens, layout.token_digest([1, 2, 3])], *plan["shards"][0]["samples"][1:]]
    assert edited[0][2] != digest
    write_json(copy / layout.PLAN, plan | {"shards": [plan["shards"][0] | {"samples": edited}, *plan["shards"][1:]]})
    changed = check(copy)
    zero, done0 = changed.shards[0], before.shards[0]
    assert (zero.samples_done, zero.samples_total) == (done0.samples_done - 1, done0.samples_total)
    assert zero.tokens_done == done0.tokens_done - tokens and zero.unjournaled_files == 1
    assert [s.samples_done for s in changed.shards[1:]] == [s.samples_done for s in before.shards[1:]]


def test_will_not_fit_exit_code_and_message_through_the_cli(partial):
    run, _ = partial

    def progress(*args: str) -> subprocess.CompletedProcess:
        command = [str(DRAFTFLOW), "progress", str(run.hs_dir.parent), *args]
        return subprocess.run(command, capture_output=True, text=True)

    stopped = check(run.hs_dir)
    left = stopped.disk.extraction_left
    tight = progress("--free-bytes", str(left + 1000), "--reserve-bytes", "1M")
    assert tight.returncode == WILL_NOT_FIT, tight.stderr
    assert "WARNING    will not fit: hidden states still need" in tight.stdout
    assert "status     WILL NOT FIT (exit 3)" in tight.stdout
    roomy = progress("--free-bytes", "1TB", "--reserve-bytes", "1M", "--json")
    report = json.loads(roomy.stdout)
    assert roomy.returncode == FAILED_SHARD and report["disk"]["fits"]
    assert report["disk"]["headroom"] == 10**12 - left - 10**6
    assert parse_size("1.5TB") == 1_500_000_000_000 and parse_size("2GiB") == 2 * 1024**3
    refused = progress("--free-bytes", "lots")
    assert refused.returncode == 2 and "not a size: 'lots' (examples: 123456, 500G, 1.5TB, 2TiB)" in refused.stderr
    assert "usage: draftflow progress" in refused.stderr


def test_watch_draws_a_bar_per_shard_until_done(finished):
    out = io.StringIO()
    assert watch(finished.hs_dir, Options(), interval_s=0.01, out=out) == ON_TRACK
    frame = out.getvalue()
    assert frame.count("|" + "█" * 30 + "|") == 4  # three shards and the total, all full
    assert "shard 2" in frame and "ETA        finished" in frame


def test_later_stage_estimate_counts_the_demo_drafter(tmp_path):
    """The demo drafter (speculators, 1 layer, draft vocab 128) saves 721,792 parameters, trains 312,192."""
    demo_target = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 3072}  # fmt: skip
    (tmp_path / "target").mkdir()
    write_json(tmp_path / "target/config.json", demo_target)
    target = read_target_model(tmp_path / "target")
    assert drafter_parameters(target, num_aux=3, draft_vocab=128, num_layers=1) == (721_792, 312_192)
    run_dir = tmp_path / "results/demo"
    write_json(run_dir / "hidden_states/plan.json", plan_extraction([], 1, 1, ExtractionSettings("vllm", (2, 4, 5, 8), "float32", "test"), 128))
    config = tmp_path / "config.yaml"
    config.write_text(
        f"run: demo\ndevice: cpu\ntarget: {{path: {tmp_path / 'target'}}}\nvocab: {{draft_vocab_size: 128}}\n"
        "data: {prompt_files: [prompts.jsonl]}\n"
    )
    disk = check(run_dir, Options(configs=(config,), free_bytes=10**9)).disk
    assert disk.later_stages_detail["drafter"]["estimated"] == 4 * 721_792  # float32 on the CPU
    assert disk.later_stages == sum(d["estimated"] for d in disk.later_stages_detail.values())
    (run_dir / "drafter_trained").mkdir()
    (run_dir / "drafter_trained/model.safetensors").write_bytes(bytes(10**6))  # written already: needed no more
    assert (
        check(run_dir, Options(configs=(config,), free_bytes=10**9)).disk.later_stages
        == disk.later_stages - 10**6
    )


def test_the_cli_finds_the_extraction_beside_a_run_plan_and_says_each_error_in_one_line(tmp_path):
    run_dir = tmp_path / "results/demo"
    settings = ExtractionSettings("vllm", (2, 4, 5, 8), "float32", "test")
    write_json(run_dir / "hidden_states/plan.json", plan_extraction([], 1, 1, settings, 128))
    write_json(run_dir / "run_plan.json", {"stages": []})
    write_json(run_dir / "plan.json", {"stages": []})  # a file of the user's, or an older run plan

    def progress(path: Path) -> subprocess.CompletedProcess:
        command = [str(DRAFTFLOW), "progress", str(path), "--json"]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)

    for given in (run_dir, run_dir / "hidden_states"):
        found = progress(given)
        assert found.returncode == ON_TRACK, found.stderr
        assert json.loads(found.stdout)["hidden_states"] == str(run_dir / "hidden_states")
    (run_dir / "hidden_states/plan.json").write_text('{"shards": [')
    broken = progress(run_dir)
    assert broken.returncode == 1 and broken.stdout == ""
    assert broken.stderr.count("\n") == 1 and f"{run_dir / 'hidden_states/plan.json'}: not readable" in broken.stderr
    write_json(run_dir / "hidden_states/plan.json", {"stages": []})
    wrong = progress(run_dir)
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1 and "not an extraction plan (no shards," in wrong.stderr
    missing = progress(tmp_path)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert f"{tmp_path / 'hidden_states/plan.json'}: no extraction plan" in missing.stderr
