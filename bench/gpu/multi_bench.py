"""Two GPUs against one: extraction (two shard jobs at once) and training (torchrun, 2 processes).

``extract``: the workflow's extraction path on N GPUs at once. One process per
shard job, as Snakemake starts ``extract_server`` jobs: each takes its GPU with
``draftflow.gpus.claim_gpus(1)`` (lock files; nothing here sets
``CUDA_VISIBLE_DEVICES``), builds the target (extract_bench.py's random
Llama of the chosen shape, bf16, decoder layers compiled like
``extract.compile: true``), warms up, and then runs, when all jobs are ready
(a start file), first the extractor alone over its shard (no files), then
``draftflow.extract.shards.run_shard`` over it (files hashed, fsynced, renamed,
journaled; ``os.sync()`` at the end), then the same in ``extract.storage: fp8``
(``backend_fp8``: half the bytes), and with ``--tmpfs`` the same into a
folder in memory (no disk: what is left is the GPU and the CPU side). The
warm-up includes one untimed pass of the extractor over the job's samples
(the pinned host buffers of every batch shape get cached, as a few batches
into a real shard). Shards are the workflow's own
(``shard_samples``: a hash of the sample id). Time = from the common start to
the last job's end; tokens/s = all the samples' tokens over it. The same is
run with one job over all the samples (``--gpus 1,2``). The disk's synced
write bandwidth is measured with 8 threads (one job's writers) and 16 (two
jobs'). The lower roofline of the host in each storage is the lower of the
jobs' compute rooflines added up (``matmul_flops_per_token``: the matrix products, at
each GPU's measured matrix rate) and the disk's synced bandwidth over that
storage's bytes per token (``draftflow.extract.layout.hidden_state_bytes``).

``train``: ``draftflow.train.train_with_trainer`` (what the ``train`` rule
runs on CUDA: torchrun with ``--nproc_per_node=train.gpus`` and
``draftflow.trainer_launch``) inside ``claim_gpus(train.gpus)``, like
``scripts/train.py``, on the same view for 1 and 2 GPUs. tokens/s: the packed
tokens of the steps after the warm-up steps over the wall time between
their records (``trainer_launch``'s per-step records; rank 0 records its own
tokens, times the number of ranks, as ``draftflow.train.trainer_metrics``
counts them).

    python3 bench/gpu/multi_bench.py extract --shape 8b --out $OUT --keep .bench-scratch/multi/hs --tmpfs /dev/shm/draftflow-multi
    python3 bench/gpu/multi_bench.py train --shape 8b --out $OUT --hs-dir .bench-scratch/multi/hs
    DRAFTFLOW_GPUS=0,1 .venv/bin/python bench/gpu/multi_bench.py extract --shape tiny --device cpu --samples 24 --mean-tokens 200 --disk-gb 0.05
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from extract_bench import SHAPES, disk_write, length_stats, log, make_samples  # noqa: E402

from draftflow.extract.layout import hidden_state_bytes, shard_samples  # noqa: E402
from draftflow.gpus import claim_gpus, device_source, default_lock_dir  # noqa: E402
from draftflow.layers import resolve_layer_ids  # noqa: E402



def phases(args) -> list[str]:
    """compute: the extractor alone; backend: run_shard to the scratch disk (bf16); backend_fp8: the same
    in fp8 storage; backend_tmpfs: to --tmpfs (memory)."""
    return ["compute", "backend", "backend_fp8"] + (["backend_tmpfs"] if args.tmpfs else [])


def now() -> float:
    return time.time()


def wait_for(path: Path, timeout_s: float, alive=lambda: True) -> None:
    deadline = now() + timeout_s
    while not path.exists():
        if not alive():
            raise RuntimeError(f"a job ended before {path.name}")
        if now() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s:.0f} s")
        time.sleep(0.005)


# ---------------------------------------------------------------- extraction


def extract_worker(args) -> None:
    """One shard job: claim a GPU, build and warm the extractor, then run the phases on the start signal."""
    import torch

    from draftflow.extract.transformers_backend import compile_decoder_layers
    from extract_bench import build_model, matmul_ceiling, matmul_flops_per_token, run_backend, run_compute, sync_device

    sync = args.sync
    result: dict = {"part": args.part, "parts": args.parts, "pid": os.getpid()}
    save = lambda: (sync / f"result-{args.part}.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    say = lambda message: log(f"job {args.part}/{args.parts}: {message}")  # noqa: E731
    claim_started = now()
    with claim_gpus(1, timeout_s=120) as ids:
        result["claimed"] = ids
        result["claim_seconds"] = round(now() - claim_started, 3)
        result["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = torch.device(args.device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            result["gpu"] = {"name": props.name, "uuid": str(getattr(props, "uuid", "")),
                             "pci_bus_id": getattr(props, "pci_bus_id", None)}  # fmt: skip
        say(f"claimed {ids} (CUDA_VISIBLE_DEVICES={result['cuda_visible_devices']}) {result.get('gpu', '')}")
        shape = SHAPES[args.shape]
        layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
        samples = make_samples(args.samples, args.mean_tokens, shape["vocab_size"])
        mine = shard_samples(samples, args.part, args.parts)
        result["samples"] = length_stats(mine)
        started = now()
        model = build_model(args.shape, device, getattr(torch, args.dtype))
        sync_device(device)
        result["decoder_parameters"] = sum(p.numel() for p in model.get_decoder().parameters())
        result["matmul_flops_per_token"] = matmul_flops_per_token(model.get_decoder())
        result["build_seconds"] = round(now() - started, 1)
        if device.type == "cuda":
            result["matmul"] = matmul_ceiling(device, sustain_seconds=10)
        started = now()
        if args.compile:
            compile_decoder_layers(model.get_decoder())
        warm = make_samples(8, args.mean_tokens, shape["vocab_size"], seed=1)
        run_compute(model, warm, layer_ids, args, device)
        run_compute(model, warm[:1], layer_ids, args, device)  # batches of one sample compile apart
        # one untimed pass over the job's own samples: the pinned host buffers of every batch
        # shape are then cached, as they are a few batches into a real shard
        run_compute(model, mine, layer_ids, args, device)
        result["warm_seconds"] = round(now() - started, 1)
        say(f"built in {result['build_seconds']} s, compiled and warm in {result['warm_seconds']} s; {result['samples']}")
        save()
        for phase in phases(args):
            (sync / f"ready-{phase}-{args.part}").touch()
            wait_for(sync / f"go-{phase}", 600)
            start = float((sync / f"go-{phase}").read_text())
            marks: dict = {}
            if phase == "compute":
                run = run_compute(model, mine, layer_ids, args, device)
            else:
                storage = "fp8" if phase == "backend_fp8" else "full"
                folder = {"backend": args.scratch, "backend_fp8": args.scratch / "fp8", "backend_tmpfs": args.tmpfs}[phase]
                run = run_backend(phase, model, mine, layer_ids, args, device, folder / f"part-{args.part}",
                                  shard=args.part, marks=marks, storage=storage)  # fmt: skip
                if storage == "fp8":  # the disk holds one storage's files at a time
                    shutil.rmtree(folder / f"part-{args.part}")
            end = now()
            run.pop("timings", None)
            result[phase] = run | {"start": start, "end": end, "job_seconds": end - start, "job_tok_s": run["tokens"] / (end - start)}
            if "written" in marks:  # run_shard returned: its files written and fsynced, before os.sync()
                result[phase]["written_seconds"] = marks["written"] - start
            say(f"{phase}: {run['tokens']:,} tokens in {end - start:.2f} s = {run['tokens'] / (end - start):,.0f} tok/s")
            save()
        del model
        sync_device(device)


def extract_run(args, parts: int, scratch: Path) -> dict:
    """``parts`` shard jobs at once, one process each, started together per phase."""
    sync = scratch / "sync"
    shutil.rmtree(scratch, ignore_errors=True)
    sync.mkdir(parents=True)
    common = ["--shape", args.shape, "--device", args.device, "--dtype", args.dtype, "--samples", str(args.samples),
              "--mean-tokens", str(args.mean_tokens), "--token-budget", str(args.token_budget),
              "--in-flight", str(args.in_flight), "--writers", str(args.writers), "--sync", str(sync),
              "--scratch", str(scratch), "--parts", str(parts)] + ([] if args.compile else ["--no-compile"])  # fmt: skip
    if args.tmpfs:
        tmpfs = args.tmpfs / scratch.name
        shutil.rmtree(tmpfs, ignore_errors=True)
        common += ["--tmpfs", str(tmpfs)]
    # the jobs inherit this environment as Snakemake's jobs would: each picks its GPU by its claim
    jobs = [subprocess.Popen([sys.executable, __file__, "extract-worker", "--part", str(k), *common]) for k in range(parts)]
    alive = lambda: all(job.poll() is None for job in jobs)  # noqa: E731
    try:
        for phase in phases(args):
            for k in range(parts):
                wait_for(sync / f"ready-{phase}-{k}", args.job_timeout, alive)
            os.sync()
            (sync / f"go-{phase}.tmp").write_text(repr(now()))
            os.replace(sync / f"go-{phase}.tmp", sync / f"go-{phase}")
        for job in jobs:
            job.wait(timeout=args.job_timeout)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    results = [json.loads((sync / f"result-{k}.json").read_text()) for k in range(parts)]
    if any(job.returncode for job in jobs):
        raise RuntimeError(f"a job failed: {[job.returncode for job in jobs]}")
    if args.tmpfs:
        shutil.rmtree(args.tmpfs / scratch.name, ignore_errors=True)
    out: dict = {"gpus": parts, "jobs": results, "claimed": [r["claimed"] for r in results]}
    for phase in phases(args):
        start = min(r[phase]["start"] for r in results)
        end = max(r[phase]["end"] for r in results)
        tokens = sum(r[phase]["tokens"] for r in results)
        written = sum(r[phase]["bytes"] for r in results)
        out[phase] = {"tokens": tokens, "bytes": written, "seconds": end - start, "tok_s": tokens / (end - start),
                      "gb_s": written / (end - start) / 1e9,
                      "jobs_tok_s": [r[phase]["job_tok_s"] for r in results],
                      "jobs_seconds": [r[phase]["job_seconds"] for r in results],
                      "jobs_written_seconds": [r[phase].get("written_seconds") for r in results]}  # fmt: skip
    return out


def extract_main(args) -> None:
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "multi.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    shape = SHAPES[args.shape]
    layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
    per_file = lambda tokens, storage: hidden_state_bytes(tokens, len(layer_ids), shape["hidden_size"], args.dtype, storage)  # noqa: E731
    bytes_per_token = {storage: per_file(1, storage) - per_file(0, storage) for storage in ("full", "fp8")}
    devices, source = device_source()
    section = report["extract"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": devices, "device_source": source, "lock_dir": str(default_lock_dir()),
        "shape": args.shape, "dtype": args.dtype, "compile": args.compile, "token_budget": args.token_budget,
        "writers": args.writers, "bytes_per_token": bytes_per_token,
        "samples": length_stats(make_samples(args.samples, args.mean_tokens, shape["vocab_size"])),
    }  # fmt: skip
    save = lambda: report_path.write_text(json.dumps(report, indent=1))  # noqa: E731
    log(f"devices {devices} (from {source}); samples {section['samples']}")
    scratch = args.scratch
    scratch.mkdir(parents=True, exist_ok=True)
    if args.tmpfs:
        try:
            args.tmpfs.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            log(f"no in-memory folder {args.tmpfs} ({error}): the backend_tmpfs phase is left out")
            args.tmpfs = None
    section["tmpfs"] = str(args.tmpfs) if args.tmpfs else None
    file_bytes = args.mean_tokens * bytes_per_token["full"]
    section["disk_before"] = [disk_write(scratch, file_bytes, int(args.disk_gb * 1e9), t) for t in (args.writers, 2 * args.writers)]
    for d in section["disk_before"]:
        log(f"disk: {d['threads']} threads, {d['gb_s']:.3f} GB/s synced")
    save()
    runs = section.setdefault("runs", {})
    for parts in args.gpus:
        name = f"gpus_{parts}"
        try:
            runs[name] = extract_run(args, parts, scratch / name)
        except Exception as error:  # noqa: BLE001 - keep what the other runs measured
            runs[name] = {"error": repr(error)}
            log(f"{name}: {error!r}")
            save()
            continue
        r = runs[name]
        for phase in phases(args):
            p = r[phase]
            log(f"{parts} GPU(s), claimed {r['claimed']}, {phase}: {p['tok_s']:,.0f} tok/s {p['gb_s']:.3f} GB/s in {p['seconds']:.2f} s; "
                f"jobs {[round(t) for t in p['jobs_tok_s']]} tok/s, ended {[round(t, 2) for t in p['jobs_seconds']]} s, "
                f"files written {p['jobs_written_seconds']} s")  # fmt: skip
        if args.keep and parts == 1:
            keep = args.keep
            shutil.rmtree(keep, ignore_errors=True)
            keep.parent.mkdir(parents=True, exist_ok=True)
            os.replace(scratch / name / "part-0" / "shard-0", keep)
            samples = make_samples(args.samples, args.mean_tokens, shape["vocab_size"])
            (keep / "samples.json").write_text(json.dumps(
                [{"sample_id": s.sample_id, "tokens": len(s.token_ids)} for s in samples]))  # fmt: skip
        shutil.rmtree(scratch / name, ignore_errors=True)
        os.sync()
        save()
    section["disk_after"] = [disk_write(scratch, file_bytes, int(args.disk_gb * 1e9), 2 * args.writers)]
    log(f"disk after: {section['disk_after'][0]['gb_s']:.3f} GB/s ({2 * args.writers} threads)")
    one, two = runs.get("gpus_1", {}), runs.get("gpus_2", {})
    if "backend" in one and "backend" in two:
        section["summary"] = {
            "extract_1gpu_tok_s": one["backend"]["tok_s"],
            "extract_2gpu_tok_s": two["backend"]["tok_s"],
            "extract_2gpu_over_1gpu": two["backend"]["tok_s"] / one["backend"]["tok_s"],
            "compute_1gpu_tok_s": one["compute"]["tok_s"],
            "compute_2gpu_tok_s": two["compute"]["tok_s"],
            "compute_2gpu_over_1gpu": two["compute"]["tok_s"] / one["compute"]["tok_s"],
            "distinct_gpus": len({tuple(c) for c in two["claimed"]}) == 2,
        }
        disk_gb_s = max(d["gb_s"] for d in section["disk_before"])
        compute_tok_s = sum(job["matmul"]["sustained_tflops"] * 1e12 / job["matmul_flops_per_token"] for job in two["jobs"] if "matmul" in job)
        rooflines = {storage: min(compute_tok_s, disk_gb_s * 1e9 / per_token) for storage, per_token in bytes_per_token.items()}
        section["summary"] |= {
            "extract_2gpu_over_1gpu_fp8": two["backend_fp8"]["tok_s"] / one["backend_fp8"]["tok_s"],
            "extract_1gpu_fp8_tok_s": one["backend_fp8"]["tok_s"],
            "extract_2gpu_fp8_tok_s": two["backend_fp8"]["tok_s"],
            "roofline_2gpu_compute_tok_s": compute_tok_s,
            "roofline_2gpu_disk_tok_s": {storage: disk_gb_s * 1e9 / per_token for storage, per_token in bytes_per_token.items()},
            "extract_2gpu_over_lower_roofline": two["backend_fp8"]["tok_s"] / rooflines["fp8"] if compute_tok_s else None,
            "extract_2gpu_over_lower_roofline_bf16": two["backend"]["tok_s"] / rooflines["full"] if compute_tok_s else None,
        }
        if "backend_tmpfs" in one and "backend_tmpfs" in two:
            section["summary"] |= {
                "tmpfs_1gpu_tok_s": one["backend_tmpfs"]["tok_s"],
                "tmpfs_2gpu_tok_s": two["backend_tmpfs"]["tok_s"],
                "tmpfs_2gpu_over_1gpu": two["backend_tmpfs"]["tok_s"] / one["backend_tmpfs"]["tok_s"],
            }
        log(f"summary: {section['summary']}")
    save()


# ---------------------------------------------------------------- training


def step_rate(metrics: Path, ranks: int, warmup: int) -> dict:
    """tokens/s of the steps after ``warmup`` from trainer_launch's records (rank 0's tokens x ranks)."""
    entries = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [e for e in entries if "step" in e and e.get("profile")]
    peaks = [e["peak_memory_gib"] for e in entries if "peak_memory_gib" in e]
    out: dict = {"steps": len(steps), "peak_memory_gib": peaks}
    if len(steps) <= warmup + 1:
        return out
    timed = steps[warmup:]
    seconds = timed[-1]["time"] - steps[warmup - 1]["time"]
    rank0 = [s["profile"]["tokens_per_s"] * s["profile"]["step_ms"] / 1000 for s in timed]
    step_ms = sorted(s["profile"]["step_ms"] for s in timed)
    return out | {
        "steps_timed": len(timed), "seconds": seconds, "tokens": ranks * sum(rank0),
        "tok_s": ranks * sum(rank0) / seconds, "step_s": seconds / len(timed),
        "median_step_ms": step_ms[len(step_ms) // 2], "rank0_tokens_per_step": sum(rank0) / len(rank0),
        "first_step_ms": steps[0]["profile"]["step_ms"],
        "fetch_ms_median": sorted(s["profile"].get("fetch_ms", 0) for s in timed)[len(timed) // 2],
    }  # fmt: skip


def train_main(args) -> None:
    from train_bench import SHAPES as TRAIN_SHAPES
    from train_bench import prepare

    from draftflow.train import TrainSettings, train_with_trainer

    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "multi.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    save = lambda: report_path.write_text(json.dumps(report, indent=1))  # noqa: E731
    shape = TRAIN_SHAPES[args.shape]
    layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    section = report["train"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape, "seq_length": args.seq_length, "warmup_steps_untimed": args.warmup,
    }  # fmt: skip
    started = time.perf_counter()
    rows = None
    if args.hs_dir and (args.hs_dir / "samples.json").exists():
        rows = json.loads((args.hs_dir / "samples.json").read_text())
        section["hidden_states"] = f"extraction output ({args.hs_dir})"
    else:
        args.hs_dir = None
        section["hidden_states"] = "random (train_bench.synthetic_hidden_states)"
    # the verifier's random tensors on the CPU: this process holds no GPU while the jobs run
    prepared = prepare(shape, layer_ids, work, args.hs_dir, rows, args.attention, "cpu", args.synthetic_samples)
    section["data"], section["init_seconds"] = prepared["data"], prepared["init_seconds"]
    from datasets import load_from_disk

    lengths = [int(n) for n in load_from_disk(str(prepared["view"])).with_format(None)["seq_len"]]
    # the Trainer trains on the view's first 99% of rows (train_with_trainer's --train-data-ratio)
    section["data"]["train_tokens"] = int(sum(lengths[: int(len(lengths) * 0.99)]))
    section["setup_seconds"] = time.perf_counter() - started
    log(f"setup: {section['data']}, {section['setup_seconds']:.0f} s")
    save()
    runs = section.setdefault("runs", {})
    for gpus in args.gpus:
        settings = TrainSettings(
            epochs=1, lr=1.0e-4, weight_decay=0.0, warmup_steps=3, ttt_steps=3, ttt_step_loss_decay=1.0,
            seq_length=args.seq_length, loss_fn="kl_div", loss_implementation="eager", attention=args.attention,
            num_layers=1, checkpoint_every_steps=500, gpus=gpus, seed=0, device="cuda", selection_samples=0, early_stopping_patience=None,
        )  # fmt: skip
        name = f"gpus_{gpus}"
        run_dir = work / name
        started = time.perf_counter()
        try:
            with claim_gpus(gpus, timeout_s=120) as ids:
                log(f"train on {gpus} GPU(s): claimed {ids}")
                stats = train_with_trainer(prepared["init_dir"], prepared["view"], settings, run_dir, work / f"drafter-{gpus}", None)
        except Exception as error:  # noqa: BLE001 - keep what the other runs measured
            runs[name] = {"error": repr(error), "wall_seconds": time.perf_counter() - started}
            log(f"{name}: {error!r}")
            save()
            continue
        stats.pop("loss_history", None)
        runs[name] = {"claimed": ids, "wall_seconds": time.perf_counter() - started, "workflow_stats": stats,
                      **step_rate(run_dir / "metrics.jsonl", gpus, args.warmup)}  # fmt: skip
        add_epoch_rate(runs[name], section["data"]["train_tokens"])
        r = runs[name]
        log(f"{name}: {r.get('tok_s', 0):,.0f} tok/s over {r.get('steps_timed', 0)} steps "
            f"(median step {r.get('median_step_ms', 0):.0f} ms), wall {r['wall_seconds']:.0f} s, peak {r['peak_memory_gib']}")  # fmt: skip
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(work / f"drafter-{gpus}", ignore_errors=True)
        save()
    summarize_train(section)
    if "summary" in section:
        log(f"summary: {section['summary']}")
    save()


def add_epoch_rate(run: dict, train_tokens: int) -> None:
    """tokens/s with exact tokens: the epoch's train tokens over (steps x the timed mean step time).

    The records hold rank 0's tokens only; the ranks' batches differ (the
    sampler packs each rank's 8,192-token sequences), so ``tok_s`` (rank 0's
    tokens x ranks, as ``draftflow.train.trainer_metrics`` counts) is off by
    the ranks' difference in packing; this is not.
    """
    if run.get("steps") and run.get("step_s"):
        run["epoch_tokens_per_step"] = train_tokens / run["steps"]
        run["epoch_tok_s"] = train_tokens / (run["steps"] * run["step_s"])


def summarize_train(section: dict) -> None:
    one, two = section["runs"].get("gpus_1", {}), section["runs"].get("gpus_2", {})
    if "epoch_tok_s" in one and "epoch_tok_s" in two:
        section["summary"] = {
            "train_1gpu_tok_s": one["epoch_tok_s"], "train_2gpu_tok_s": two["epoch_tok_s"],
            "train_2gpu_over_1gpu": two["epoch_tok_s"] / one["epoch_tok_s"],
            "rank0_count_2gpu_over_1gpu": two["tok_s"] / one["tok_s"],
            # the same 8,192-token sequences per GPU and step: what the second GPU adds, packing aside
            "step_scaling_2gpu": 2 * one["step_s"] / two["step_s"],
            "tokens_per_gpu_step": [one["epoch_tokens_per_step"], two["epoch_tokens_per_step"] / 2],
        }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gpus = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    for name in ("extract", "extract-worker", "train"):
        p = sub.add_parser(name)
        p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
        p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench/results")))
        p.add_argument("--gpus", type=gpus, default=[1, 2], help="GPU counts to run, in order")
    for p in (sub.choices["extract"], sub.choices["extract-worker"]):
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        p.add_argument("--samples", type=int, default=256)
        p.add_argument("--mean-tokens", type=int, default=2000)
        p.add_argument("--token-budget", type=int, default=32768)
        p.add_argument("--in-flight", type=int, default=2)
        p.add_argument("--writers", type=int, default=8)
        p.add_argument("--no-compile", dest="compile", action="store_false", help="extract.compile: false")
        p.add_argument("--scratch", type=Path, default=REPO / ".bench-scratch/multi/extract")
        p.add_argument("--tmpfs", type=Path, help="also run the backend writing to this folder in memory (e.g. /dev/shm/...)")
    ex = sub.choices["extract"]
    ex.add_argument("--disk-gb", type=float, default=3.0)
    ex.add_argument("--job-timeout", type=float, default=300)
    ex.add_argument("--keep", type=Path, help="move the 1-GPU run's files here (for train --hs-dir)")
    wk = sub.choices["extract-worker"]
    wk.add_argument("--part", type=int, required=True)
    wk.add_argument("--parts", type=int, required=True)
    wk.add_argument("--sync", type=Path, required=True)
    tr = sub.choices["train"]
    tr.add_argument("--hs-dir", type=Path, help="hidden-state files with samples.json (extract --keep); else random")
    tr.add_argument("--synthetic-samples", type=int, default=256, help="random samples written when --hs-dir has none")
    tr.add_argument("--seq-length", type=int, default=8192)
    tr.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile)")
    tr.add_argument("--attention", default="sdpa")
    tr.add_argument("--work", type=Path, default=REPO / ".bench-scratch/multi/train")
    args = parser.parse_args()
    {"extract": extract_main, "extract-worker": extract_worker, "train": train_main}[args.command](args)


if __name__ == "__main__":
    main()
