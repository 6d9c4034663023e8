"""The plan (python -m draftflow.plan): the 1T reference run from its numbers, and the demo against itself."""

import json

import pytest
import yaml

from draftflow.config import load_config
from draftflow.costs import tree_bytes
from draftflow.plan import (
    FITS,
    MEASURED_GENERATION,
    WILL_NOT_FIT,
    build_plan,
    load_rates,
    main,
    measured_generation_rate,
    plan_warnings,
    rates_from_run,
    write_plan,
)
from draftflow.target_model import read_target_model
from tests.conftest import REPO, demo_config

# The reference run of issue 14: a 1T MoE (Kimi-K2 class: hidden 7168, 61
# layers) at tensor parallel 8 on one 8-GPU node; the model loaded in 24.5
# minutes, extraction ran at 2.5 samples/s, 10,000 samples of 83.1 MB each
# (1,449 tokens at 4 layer ids x 7168 x bf16 + the token id) against 2.8 TB free.
TOKENS_PER_SAMPLE = 1449
REFERENCE_RATES = {"model_load_s": 24.5 * 60, "extract_tokens_per_s": 2.5 * TOKENS_PER_SAMPLE}


@pytest.fixture
def reference_run(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
        "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 192,
    }))  # fmt: skip
    index = {"metadata": {"total_size": 594_000_000_000}, "weight_map": {}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    config = yaml.safe_load((REPO / "config/examples/moe-1t-8gpu.yaml").read_text())
    config["target"]["path"] = str(target)
    config["data"]["prompt_files"] = [str(tmp_path / "prompts.jsonl")]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "results/moe-1t"
    (run_dir / "prepared").mkdir(parents=True)
    prepared = {"kept": 10_000, "tokens": 10_000 * TOKENS_PER_SAMPLE, "supervised_tokens": 10_000 * 1000}
    (run_dir / "prepared/stats.json").write_text(json.dumps(prepared))
    (tmp_path / "rates.yaml").write_text(yaml.safe_dump(REFERENCE_RATES))
    return tmp_path


def test_the_reference_run_extracts_831_gb_in_one_load_and_1h31m(reference_run):
    config = load_config(reference_run / "config.yaml")
    rates = load_rates(reference_run / "rates.yaml", "cuda")
    plan = build_plan(config, reference_run / "results/moe-1t", rates, free_bytes=2_800_000_000_000, local_gpus=8)
    extract = next(s for s in plan.stages if s.name == "extract_server")
    assert (extract.jobs, extract.gpus_per_job, extract.model_loads) == (1, 8, 1)  # 64 shards, one load
    assert extract.bytes_written == pytest.approx(831e9, rel=0.001)
    assert extract.seconds == pytest.approx(24.5 * 60 + 10_000 / 2.5, rel=1e-6)  # 1 h 31 min
    assert extract.gpu_hours == pytest.approx(8 * extract.seconds / 3600)
    assert plan.exit_code == FITS and plan.peak_bytes < 2.8e12
    # 24.5 of 91 minutes is more than a quarter: said, with no advice to load less often (one load already)
    assert "extract_server: model loads take 24m30s of its 1h31m" in plan.warnings


def test_the_cli_prints_the_plan_and_exits_3_when_it_will_not_fit(reference_run, capsys, monkeypatch):
    monkeypatch.chdir(reference_run)
    arguments = ["--configfile", "config.yaml", "--rates", "rates.yaml", "--gpus", "8"]
    assert main([*arguments, "--free-bytes", "2.8TB"]) == FITS
    markdown = capsys.readouterr().out
    assert "| extract_server | 1 | 8 | 1 | 831.03 GB | 1h31m |" in markdown
    assert main([*arguments, "--free-bytes", "500GB", "--json"]) == WILL_NOT_FIT
    plan = json.loads(capsys.readouterr().out)
    assert plan["exit_code"] == WILL_NOT_FIT and plan["warnings"][0].startswith("will not fit")


def test_sixty_four_servers_would_spend_the_stage_loading(reference_run):
    """The choice this issue is about: one server per shard (64 loads) on one node."""
    config = load_config(reference_run / "config.yaml")
    config["extract"]["servers"] = 64
    rates = load_rates(reference_run / "rates.yaml", "cuda")
    plan = build_plan(config, reference_run / "results/moe-1t", rates, free_bytes=2_800_000_000_000, local_gpus=8)
    extract = next(s for s in plan.stages if s.name == "extract_server")
    assert extract.model_loads == 64 and extract.seconds > 26 * 3600
    assert any(w.startswith("extract_server: model loads take") and "fewer extract.servers" in w for w in plan.warnings)


# The source run of issue 45 generated its 10,000 answers (1,000 response tokens each) in
# 5.3 hours on the same node.
REFERENCE_GENERATION = {"generate_tokens_per_s": 10_000 * 1000 / (5.3 * 3600)}


def test_four_generation_jobs_on_a_cluster_cut_generations_wall_time_and_add_only_their_loads(reference_run):
    """Each job asks a quarter and loads the model once: the wall time falls by 4x but for
    the load, and the GPU-hours are one job's plus three more loads."""
    (reference_run / "rates.yaml").write_text(yaml.safe_dump(REFERENCE_RATES | REFERENCE_GENERATION))
    rates = load_rates(reference_run / "rates.yaml", "cuda")
    config = load_config(reference_run / "config.yaml")
    plans = {}
    for servers in (1, 4):
        config["generate"]["servers"] = servers
        plan = build_plan(config, reference_run / "results/moe-1t", rates, free_bytes=2_800_000_000_000, local_gpus=None)
        plans[servers] = next(s for s in plan.stages if s.name == "generate_server")
    one, four = plans[1], plans[4]
    load = REFERENCE_RATES["model_load_s"]
    assert (one.jobs, one.model_loads, four.jobs, four.model_loads, four.gpus_per_job) == (1, 1, 4, 4, 8)
    assert one.seconds == pytest.approx(load + 5.3 * 3600) and four.seconds == pytest.approx(load + 5.3 * 3600 / 4)
    assert 3.2 < one.seconds / four.seconds < 4  # 5 h 43 min -> 1 h 44 min
    assert four.gpu_hours == pytest.approx(one.gpu_hours + 3 * 8 * load / 3600)


@pytest.mark.slow
def test_the_demo_plan_after_prepare_holds_the_bytes_the_demo_wrote(workdir, demo_run, tmp_path):
    """Token counts exact, the stages from extraction on estimated: within 1% of the bytes the
    run wrote there (the folders before extraction exist: the plan measures them; a plan
    made before any of them: tests/test_incremental_rebuilds.py)."""
    config_file = tmp_path / "config.yaml"  # the demo's config, not whatever another test left in the folder
    config_file.write_text(yaml.safe_dump(demo_config()))
    config = load_config(config_file)
    plan = build_plan(config, demo_run, rates_from_run(demo_run), free_bytes=10**12, local_gpus=0)
    assert plan.tokens["source"].startswith("exact")
    measured = {"prompts": "prompts", "generate_server": "synthetic", "prepare": "prepared"}  # stage -> folder it read
    estimated = sum(s.bytes_written for s in plan.stages if s.name not in measured)
    written = tree_bytes(demo_run) - sum(tree_bytes(demo_run / folder) for folder in measured.values())
    written -= sum(p.stat().st_size for p in demo_run.glob("plan.*"))  # the plan's own files
    assert estimated == pytest.approx(written, rel=0.01)
    extract = next(s for s in plan.stages if s.name == "extract_server")
    assert demo_config()["extract"]["shards"] == 2 and extract.jobs == 1
    # the demo's own config again: every answer and every hidden-state file is kept, nothing loads a model
    generate = next(s for s in plan.stages if s.name == "generate_server")
    conversations, samples = plan.tokens["conversations"], plan.tokens["samples"]  # a sample per answered turn
    assert conversations == 240 + 80 and samples > conversations  # MT-Bench's questions have two turns
    assert (generate.reused, generate.computed, generate.model_loads) == (conversations, 0, 0)
    assert (extract.reused, extract.computed, extract.model_loads) == (samples, 0, 0)


@pytest.mark.parametrize("gpu_memory_gib", [80, 141])
def test_a_target_too_large_for_its_gpus_is_refused_naming_the_ways_out(reference_run, gpu_memory_gib):
    """594 GB of weights over 8 GPUs is 69 GiB each, with 6.1 GB of KV cache for one 16k
    sequence (the fixture's 64 KV heads of 192): more than vLLM's 90% of an 80 GiB H100,
    within that of a 141 GiB H200."""
    config = load_config(reference_run / "config.yaml")
    config["vllm"]["gpu_memory_gib"] = gpu_memory_gib
    rates = load_rates(reference_run / "rates.yaml", "cuda")
    plan = build_plan(config, reference_run / "results/moe-1t", rates, free_bytes=2_800_000_000_000, local_gpus=8)
    fit = plan.gpu_fit
    assert fit.weight_bytes == 594_000_000_000 // 8 and fit.kv_cache_bytes == 16384 * 61 * 2 * 8 * 192 * 2
    assert fit.usable_bytes == int(gpu_memory_gib * 1024**3 * 0.9)
    assert fit.fits == (gpu_memory_gib == 141)
    assert plan.exit_code == (FITS if fit.fits else WILL_NOT_FIT)
    refusals = [warning for warning in plan.warnings if warning.startswith("will not fit the GPUs")]
    assert len(refusals) == (0 if fit.fits else 1)
    if not fit.fits:
        for way_out in ("vllm.tensor_parallel_size 9 or more", "a quantised checkpoint", "a shorter vllm.max_model_len"):
            assert way_out in refusals[0]
        with pytest.raises(SystemExit, match="will not fit the GPUs.*No job was started"):
            write_plan(config, reference_run / "target", reference_run / "results/moe-1t", local_gpus=8)
        assert "GPU memory per server GPU" in (reference_run / "results/moe-1t/run_plan.md").read_text()


def test_an_mla_targets_kv_cache_is_its_latent_whole_on_every_gpu(reference_run):
    """DeepSeek-V3's attention caches kv_lora_rank + qk_rope_head_dim per layer, not per head:
    the same on each GPU whatever the tensor-parallel size."""
    config = json.loads((reference_run / "target/config.json").read_text())
    (reference_run / "target/config.json").write_text(json.dumps(config | {"kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    target = read_target_model(reference_run / "target")
    assert target.kv_cache_bytes_per_token(2, 8) == target.kv_cache_bytes_per_token(2, 1) == 61 * (512 + 64) * 2


LLAMA_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "num_hidden_layers": 32, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip


def test_the_gpu_defaults_are_measurements_scaled_to_the_target_and_say_so(tmp_path, capsys, monkeypatch):
    """The llama-8b example plans with BENCHMARKS.md's figures for its own shape; the 1T example's
    MoE with them scaled by its routed parameters and its 8 GPUs; generation at the example's
    concurrency from the rates measured at three."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama/config.json").write_text(json.dumps(LLAMA_8B))
    (tmp_path / "llama/model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}}))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "q0", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    config = yaml.safe_load((REPO / "config/examples/llama-8b-1gpu.yaml").read_text())
    config["target"]["path"] = str(tmp_path / "llama")
    config["data"]["prompt_files"] = [str(tmp_path / "prompts.jsonl")]
    config["evaluate"]["datasets"] = []
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["--configfile", "config.yaml", "--free-bytes", "2TB"]) == FITS
    markdown = capsys.readouterr().out
    assert "- extraction 39,179 tokens/s per server job: 39,179 tokens/s at 7.50B parameters per token on one H200 (BENCHMARKS.md)" in markdown
    assert "- training 36,442 tokens/s per GPU: 36,442 tokens/s per H200 at hidden size 4,096 (BENCHMARKS.md)" in markdown
    assert ("- generation 10,904 response tokens/s per server: 10,904 at generate.concurrency 128 on one H100 at 7.50B "
            "parameters per token (BENCHMARKS.md), scaled to this target's 7.50B on 1 GPU(s)") in markdown  # fmt: skip
    measured = MEASURED_GENERATION[0]
    assert measured_generation_rate(8) == measured[16] / 2  # in proportion below the first
    assert measured_generation_rate(64) == measured[64]
    assert measured_generation_rate(1024) == measured[256]  # held past the last

    kimi = {**LLAMA_8B, "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
            "head_dim": 112, "num_hidden_layers": 61, "vocab_size": 163840, "moe_intermediate_size": 2048,
            "num_experts_per_tok": 8, "n_shared_experts": 1}  # fmt: skip
    (tmp_path / "llama/config.json").write_text(json.dumps(kimi))
    config = load_config(tmp_path / "config.yaml")
    config["vllm"]["tensor_parallel_size"] = 8
    plan = build_plan(config, tmp_path / "results/llama-8b", load_rates(None, "cuda"), free_bytes=2 * 10**12, local_gpus=8)
    per_token = 61 * (7168 * 112 * 2 * 128 + 3 * 7168 * 2048 * 9) + 7168 * 163840
    extraction = next(note for note in plan.rate_notes if note.startswith("extraction"))
    assert extraction.startswith(f"extraction {39179 * 7_504_658_432 / per_token * 8:,.0f} tokens/s per server job")
    assert f"{per_token / 1e9:.2f}B on 8 GPU(s)" in extraction
    assert any(note.startswith(f"training {36442 * (4096 / 7168) ** 2:,.0f} tokens/s per GPU") for note in plan.rate_notes)


def test_answers_cut_at_max_tokens_so_far_say_what_truncation_costs_before_the_rest_is_asked():
    """A pilot's answers cut at generate.max_tokens (a thinking model's): the plan of the larger
    run says so, what a cut costs, and that raising it later asks everything again."""
    config = load_config(REPO / "config/config.yaml")
    work = {"samples": 100, "to_ask": 80, "answered_before": 20, "cut_at_max_tokens": 7}
    (warning,) = [w for w in plan_warnings(config, work, [], 0, 1, None) if w.startswith("generate.max_tokens")]
    assert warning.startswith("generate.max_tokens 256: 7 of the answers so far were cut there (of 20 conversations answered)")
    assert "generate.max_degenerate_fraction 25%" in warning and "asks every conversation again" in warning
    assert not [w for w in plan_warnings(config, {**work, "to_ask": 0}, [], 0, 1, None) if w.startswith("generate.max_tokens")]
    assert not [w for w in plan_warnings(config, {**work, "cut_at_max_tokens": 0}, [], 0, 1, None) if w.startswith("generate.max_tokens")]
