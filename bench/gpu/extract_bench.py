"""Extraction throughput on one GPU, end to end (samples in -> files synced on disk).

One run measures, in this order, on the machine it runs on:

1. the ceilings: the bf16 matrix rate (8192^3 products, CUDA events: the
   median of 20 timed one by one, a burst, and sustained over --sustain-seconds)
   and the disk's synced write bandwidth (files of one sample's size, each
   fsynced, 1 and --writers threads, then os.sync);
2. ``compute``: draftflow's ``TransformersExtractor`` alone (forward passes +
   copies to the host, nothing written);
3. ``write``: ``write_sample`` alone on host tensors, 1 thread and --writers;
4. ``baseline``: the simplest loop (batch of one, ``output_hidden_states=True``,
   logits computed, ``.cpu()``, ``safetensors.save_file`` per sample), over
   the first --baseline-samples;
5. ``backend_eager``: ``draftflow.extract.shards.run_shard`` with the extractor
   (the workflow's path: files written on --writers threads, each serialized,
   hashed, fsynced, renamed and journaled), decoder layers not compiled;
6. the decoder layers compiled (``extract.compile``, on by default on CUDA; the
   compile time is reported, not timed in the runs), then ``compute`` again,
   ``backend_fp8`` (``extract.storage: fp8``), ``backend_padded`` (right-padded
   rows instead of packed samples, for comparison; its graph compiled before)
   and ``backend``: the default settings, the workflow's GPU path and the
   number BENCHMARKS.md reports; each run's padding share is recorded;
7. the disk again, to see that it did not change under the runs.

Every timed region ends with ``os.sync()``. The target is a Llama of the
chosen shape with random weights made on the device (nothing is downloaded);
samples have random token ids and lognormal lengths (mean --mean-tokens).
The roofline is the lower of the matrix products' FLOPs per token
(``matmul_flops_per_token``: 2 x the decoder's parameters less the embedding,
which is a lookup) at the measured sustained matrix rate and the measured disk
bandwidth over the bytes written per token. Attention's FLOPs
(``attention_flops``, causal, over these samples' lengths) are reported beside
it, not in it. The extraction's ratio to the compute roofline is given at three
rates side by side: the sustained rate, the burst rate (the card holds it only
briefly, then lowers its clock to stay within its power limit) and the card's
spec rate (``SPEC_TFLOPS``: dense bf16, without sparsity).

    python3 bench/gpu/extract_bench.py --shape 8b --out $OUT            # on the GPU
    .venv/bin/python bench/gpu/extract_bench.py --shape tiny --device cpu --samples 24 --mean-tokens 200  # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from draftflow.extract.transformers_backend import TransformersExtractor, compile_decoder_layers  # noqa: E402
from draftflow.extract import layout  # noqa: E402
from draftflow.extract.layout import Sample  # noqa: E402
from draftflow.extract.shards import ExtractionSettings, run_shard  # noqa: E402
from draftflow.extract.hidden_states import write_sample  # noqa: E402
from draftflow.layers import resolve_layer_ids  # noqa: E402

SHAPES = {
    # Llama-3.1-8B
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072),
    # for smoke tests on a CPU
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384),
}  # fmt: skip


# the card's dense bf16 matrix rate from its spec sheet (without sparsity), TFLOP/s, by torch's device name
SPEC_TFLOPS = {
    "NVIDIA H200": 989.0,  # H200 SXM: 1,979 with 2:4 sparsity, 989 dense
}


def matmul_flops_per_token(decoder: torch.nn.Module) -> int:
    """The matrix products' FLOPs per token of a decoder (no lm_head): 2 x its parameters less
    the embedding's (a lookup, no product). The norms' few weights stay in (0.004% at the 8B
    shape). Attention's products (queries x keys, weights x values) are not parameters:
    ``attention_flops`` counts them."""
    embedding = decoder.get_input_embeddings().weight.numel()
    return 2 * (sum(p.numel() for p in decoder.parameters()) - embedding)


def attention_flops(lengths: list[int], layers: int, heads: int, head_dim: int) -> int:
    """Causal attention's FLOPs over samples of these lengths, each attending only to itself:
    queries x keys and weights x values, 2 x 2 x heads x head_dim x n^2 per layer for a sample
    of n tokens, halved by the causal mask."""
    return 2 * layers * heads * head_dim * sum(n * n for n in lengths)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_samples(count: int, mean_tokens: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Lognormal lengths (sigma 0.6, about the spread of chat answers), mean ``mean_tokens``."""
    generator = torch.Generator().manual_seed(seed)
    sigma = 0.6
    mu = math.log(mean_tokens) - sigma**2 / 2
    lengths = torch.exp(mu + sigma * torch.randn(count, generator=generator)).round().clamp(32, 4 * mean_tokens)
    return [
        Sample(i, f"bench-{i}", torch.randint(0, vocab, (int(n),), generator=generator).tolist())
        for i, n in enumerate(lengths.tolist())
    ]


def length_stats(samples: list[Sample]) -> dict:
    lengths = sorted(len(s.token_ids) for s in samples)
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"samples": len(lengths), "tokens": sum(lengths), "mean": round(statistics.mean(lengths), 1),
            "min": lengths[0], "p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": lengths[-1]}  # fmt: skip


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> dict:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    median = statistics.median(times)
    return {"n": n, "reps": reps, "median_s": median, "tflops": 2 * n**3 / median / 1e12,
            "best_tflops": 2 * n**3 / min(times) / 1e12}  # fmt: skip


class GpuSampler:
    """nvidia-smi's SM clock, power draw, temperature and clock-event reasons of one GPU every 250 ms."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, device: torch.device):
        # by UUID: CUDA_VISIBLE_DEVICES renumbers the devices torch sees, not nvidia-smi's
        self.gpu = f"GPU-{torch.cuda.get_device_properties(device).uuid}"

    def __enter__(self):
        self.process = subprocess.Popen(
            ["nvidia-smi", "-i", self.gpu, f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.thread.join(timeout=5)

    def summary(self) -> dict:
        rows = [line.strip().split(", ") for line in self.lines if line.count(",") == 4]
        numbers = lambda i: [float(r[i]) for r in rows if r[i].replace(".", "", 1).isdigit()]  # noqa: E731
        clocks, power, temps = numbers(1), numbers(2), numbers(3)
        return {
            "samples": len(rows),
            "sm_mhz": {"min": min(clocks, default=None), "median": statistics.median(clocks) if clocks else None,
                       "max": max(clocks, default=None)},
            "power_w": {"median": statistics.median(power) if power else None, "max": max(power, default=None)},
            "temperature_c_max": max(temps, default=None),
            "clock_event_reasons": sorted({r[4] for r in rows}),
        }  # fmt: skip


def matmul_ceiling(device: torch.device, sustain_seconds: float, n: int = 8192) -> dict:
    """The bf16 matrix rate as a burst (``matmul_tflops``) and sustained: products back to
    back for ``sustain_seconds``, the rate of each second (its median is the ceiling a
    long extraction can reach: under sustained load the card holds its power limit by
    lowering its clock), with what nvidia-smi saw meanwhile."""
    burst = matmul_tflops(device, n)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    per_second, started = [], time.perf_counter()
    with GpuSampler(device) as sampler:
        while time.perf_counter() - started < sustain_seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(700):  # about a second at 790 TFLOP/s
                a @ b
            end.record()
            end.synchronize()
            per_second.append(700 * 2 * n**3 / (start.elapsed_time(end) / 1000) / 1e12)
    return {
        "burst": burst, "sustained_tflops": statistics.median(per_second[1:] or per_second),
        "per_second_tflops": per_second, "gpu": sampler.summary(),
    }  # fmt: skip


def disk_write(scratch: Path, file_bytes: int, total_bytes: int, threads: int) -> dict:
    """Synced write bandwidth: files of one sample's size, each fsynced, then os.sync()."""
    directory = scratch / f"disk-{threads}"
    directory.mkdir(parents=True, exist_ok=True)
    pool_bytes = file_bytes + 64 * 1024 * 1024
    data = memoryview(os.urandom(pool_bytes))
    count = max(threads, total_bytes // file_bytes)

    def one(i: int) -> None:
        offset = (i * 4096 * 1031) % (pool_bytes - file_bytes)
        with open(directory / f"f{i}", "wb") as stream:
            stream.write(data[offset : offset + file_bytes])
            stream.flush()
            os.fsync(stream.fileno())

    os.sync()
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))
    os.sync()
    seconds = time.perf_counter() - started
    shutil.rmtree(directory)
    os.sync()
    return {"threads": threads, "files": count, "file_bytes": file_bytes, "bytes": count * file_bytes,
            "seconds": seconds, "gb_s": count * file_bytes / seconds / 1e9}  # fmt: skip


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@contextmanager
def extractor_of(model, layer_ids, token_budget, device, in_flight, holder: dict, storage: str = "full", padded=False):
    # padded: right-padded rows, as a decoder that cannot pack gets them (for comparison)
    extractor = TransformersExtractor(model, layer_ids, token_budget, str(device), in_flight, storage, padded_rows=padded)
    holder["extractor"] = extractor
    try:
        yield extractor
    finally:
        extractor.close()


def result_of(name: str, tokens: int, written: int, seconds: float, **extra) -> dict:
    return {"name": name, "tokens": tokens, "bytes": written, "seconds": round(seconds, 3),
            "tok_s": tokens / seconds, "gb_s": written / seconds / 1e9, **extra}  # fmt: skip


def run_compute(model, samples, layer_ids, args, device, name: str = "compute", padded: bool = False) -> dict:
    holder: dict = {}
    sync_device(device)
    started = time.perf_counter()
    with extractor_of(model, layer_ids, args.token_budget, device, args.in_flight, holder, padded=padded) as extract:
        tokens = sum(states.shape[0] for _, states in extract(samples))
    sync_device(device)
    seconds = time.perf_counter() - started
    return result_of(name, tokens, 0, seconds, timings=holder["extractor"].timings)


def run_write_only(samples, num_layers, hidden, writers, scratch) -> dict:
    """write_sample alone on host tensors of the samples' shapes (1 thread, then ``writers``)."""
    tensors = [(s, torch.randn(len(s.token_ids), num_layers, hidden).to(torch.bfloat16)) for s in samples]
    token_ids = {s.sample_id: torch.tensor(s.token_ids) for s in samples}
    out = {}
    for threads in (1, writers):
        directory = scratch / f"write-{threads}"
        directory.mkdir(parents=True, exist_ok=True)
        os.sync()
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            records = list(pool.map(lambda item: write_sample(directory, item[0].sample_id, item[1], token_ids[item[0].sample_id]), tensors))
        os.sync()
        seconds = time.perf_counter() - started
        out[f"threads_{threads}"] = result_of(f"write_{threads}", sum(r.tokens for r in records), sum(r.bytes for r in records), seconds)
        shutil.rmtree(directory)
        os.sync()
    return out


def write_components(directory: Path, tokens: int, num_layers: int, hidden: int, reps: int = 5) -> dict:
    """Where one sample's write goes (medians): serialize, sha256, write + fsync, rename."""
    import hashlib

    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    states = torch.randn(tokens, num_layers, hidden).to(torch.bfloat16)
    token_ids = torch.arange(tokens)
    times: dict[str, list[float]] = {"serialize_s": [], "sha256_s": [], "write_fsync_s": [], "rename_s": []}
    for i in range(reps):
        started = time.perf_counter()
        payload = save({"hidden_states": states.contiguous(), "token_ids": token_ids})
        times["serialize_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        hashlib.sha256(payload).hexdigest()
        times["sha256_s"].append(time.perf_counter() - started)
        tmp = directory / f".f{i}.tmp"
        started = time.perf_counter()
        with tmp.open("wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
        times["write_fsync_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        os.replace(tmp, directory / f"f{i}")
        times["rename_s"].append(time.perf_counter() - started)
    shutil.rmtree(directory)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["bytes"] = len(payload)
    out["total_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
    return out


def profile_batch(model, samples, layer_ids, args, device) -> dict:
    """GPU time of one token-budget batch by kernel kind (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from draftflow.extract.transformers_backend import batches_by_token_budget

    batches = list(batches_by_token_budget(samples, args.token_budget))
    batch = batches[len(batches) // 2]
    holder: dict = {}
    with extractor_of(model, layer_ids, args.token_budget, device, 1, holder) as extract:
        for _ in extract(batch):  # warm for this shape
            pass
        sync_device(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in extract(batch):
                pass
            sync_device(device)
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        time_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if not time_us or getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
            continue
        name = event.key.lower()
        kind = (
            "matmul" if any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_"))
            else "attention" if any(k in name for k in ("flash", "fmha", "attention", "cudnn"))
            else "copy" if "memcpy" in name or "memset" in name
            else "elementwise/norm/other"
        )  # fmt: skip
        kinds[kind] = kinds.get(kind, 0.0) + time_us / 1e6
    padded = holder["extractor"].timings["padded_tokens"] // 2  # the warm-up run's and the profiled run's
    matmul_flops = matmul_flops_per_token(model.get_decoder()) * padded
    total = sum(kinds.values())
    return {
        "batch_samples": len(batch), "padded_tokens": padded, "real_tokens": sum(len(s.token_ids) for s in batch),
        "gpu_seconds": kinds, "gpu_total_s": total,
        "shares": {k: v / total for k, v in kinds.items()} if total else {},
        "matmul_tflops": matmul_flops / kinds["matmul"] / 1e12 if kinds.get("matmul") else None,
        "padded_tok_s_gpu": padded / total if total else None,
    }  # fmt: skip


def run_baseline(model, samples, layer_ids, device, directory: Path) -> dict:
    """The simplest loop: batch of one, output_hidden_states=True, synchronous save per sample."""
    directory.mkdir(parents=True, exist_ok=True)
    os.sync()
    sync_device(device)
    started = time.perf_counter()
    written = 0
    for sample in samples:
        with torch.inference_mode():
            output = model(input_ids=torch.tensor([sample.token_ids], device=device), output_hidden_states=True)
        states = torch.stack([output.hidden_states[k][0] for k in layer_ids], dim=1).cpu()
        path = directory / layout.file_name(sample.sample_id)
        save_file({"hidden_states": states, "token_ids": torch.tensor(sample.token_ids)}, str(path))
        written += path.stat().st_size
    os.sync()
    seconds = time.perf_counter() - started
    return result_of("baseline", sum(len(s.token_ids) for s in samples), written, seconds)


def run_backend(name, model, samples, layer_ids, args, device, directory: Path, token_budget: int | None = None,
                shard: int = 0, marks: dict | None = None, storage: str = "full", padded: bool = False) -> dict:
    """``run_shard`` over ``samples`` into ``directory/shard-{shard}``, then ``os.sync()``;
    ``marks["written"]``: wall-clock time when run_shard returned (every file fsynced), before the sync."""
    token_budget = token_budget or args.token_budget
    holder: dict = {}
    settings = ExtractionSettings("transformers", tuple(layer_ids), args.dtype, "bench", storage)
    os.sync()
    sync_device(device)
    started = time.perf_counter()
    records = run_shard(
        samples, shard, directory / f"shard-{shard}", directory / f"shard-{shard}.heartbeat.json", settings,
        lambda: extractor_of(model, layer_ids, token_budget, device, args.in_flight, holder, storage, padded), writers=args.writers,
    )  # fmt: skip
    if marks is not None:
        marks["written"] = time.time()
    os.sync()
    seconds = time.perf_counter() - started
    tokens, written = sum(r.tokens for r in records), sum(r.bytes for r in records)
    timings = holder["extractor"].timings
    return result_of(name, tokens, written, seconds, timings=timings, writers=args.writers, token_budget=token_budget,
                     storage=storage, padding_fraction=1 - timings["tokens"] / timings["padded_tokens"])  # fmt: skip


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def compare_files(backend_dir: Path, baseline_dir: Path, samples: list[Sample], aux_slots: int) -> list[dict]:
    """Aux layers from the backend (batched, no mask) against the baseline (batch of one).

    The last slot differs by design: the backend keeps the last layer's output
    before the final norm; output_hidden_states' last entry is after it.
    """
    out = []
    for sample in samples:
        with safe_open(str(backend_dir / layout.file_name(sample.sample_id)), "pt") as f:
            ours, ours_ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        with safe_open(str(baseline_dir / layout.file_name(sample.sample_id)), "pt") as f:
            theirs = f.get_tensor("hidden_states")
        out.append({
            "sample_id": sample.sample_id, "tokens": len(sample.token_ids),
            "token_ids_match": ours_ids.tolist() == sample.token_ids,
            "shape_match": list(ours.shape) == list(theirs.shape),
            "aux_relative_error": [relative_error(ours[:, k], theirs[:, k]) for k in range(aux_slots)],
        })  # fmt: skip
    return out


def sweep_parser(description: str, scratch: str, samples: int) -> argparse.ArgumentParser:
    """The arguments of every script that reruns the workflow's extraction path (fp8_bench,
    in_flight_sweep, consumer_sweep): the shape, the samples, the extraction settings, the folders."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--mean-tokens", type=int, default=2000)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--disk-gb", type=float, default=3.0, help="bytes per disk-bandwidth measurement")
    parser.add_argument("--scratch", type=Path, default=REPO / ".bench-scratch" / scratch)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench/results")))
    return parser


def sweep_setup(args) -> tuple[torch.device, dict, list[int]]:
    """bf16, an emptied scratch folder and the out folder; the device, the shape and the
    workflow's default layer ids for it."""
    args.dtype = "bfloat16"
    shutil.rmtree(args.scratch, ignore_errors=True)
    args.scratch.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    return torch.device(args.device), shape, resolve_layer_ids(None, shape["num_hidden_layers"])


def machine_info(scratch: Path, device: torch.device) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count()}  # fmt: skip
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    usage = shutil.disk_usage(scratch)
    info["scratch"] = {"path": str(scratch), "free_gb": round(usage.free / 1e9, 1), "total_gb": round(usage.total / 1e9, 1)}
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
        best = max((m for m in mounts if str(scratch.resolve()).startswith(m[1])), key=lambda m: len(m[1]))
        info["scratch"]["mount"] = {"device": best[0], "mountpoint": best[1], "fstype": best[2]}
    except Exception:  # noqa: BLE001
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--samples", type=int, default=512, help="at most this many samples (fewer when the disk is slow, see --run-seconds)")
    parser.add_argument("--baseline-samples", type=int, default=128, help="the simplest loop runs over the first this many")
    parser.add_argument("--mean-tokens", type=int, default=2000)
    parser.add_argument("--token-budget", type=int, default=32768, help="extract.token_budget (the schema's default)")
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--writers", type=int, default=8, help="run_shard's writer threads, extract.write_threads (and the disk test)")
    parser.add_argument("--run-seconds", type=float, default=40.0, help="size the runs so that one disk-bound run takes about this long")
    parser.add_argument("--sustain-seconds", type=float, default=20.0, help="how long the sustained matrix rate is measured")
    parser.add_argument("--spec-tflops", type=float, default=None, help="the card's dense bf16 spec rate (default: SPEC_TFLOPS by its name)")
    parser.add_argument("--disk-gb", type=float, default=3.0, help="bytes per disk-bandwidth measurement")
    parser.add_argument("--scratch", type=Path, default=REPO / ".bench-scratch")
    parser.add_argument("--keep", action="store_true", help="keep the backend run's files (train_bench.py reads them)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench/results")))
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.scratch.iterdir():
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    shape = SHAPES[args.shape]
    layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
    hidden = shape["hidden_size"]
    bytes_per_token = len(layer_ids) * hidden * torch.finfo(dtype).bits // 8 + 8
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(args.scratch, device),
        "shape": {"name": args.shape, **shape}, "layer_ids": layer_ids, "dtype": args.dtype,
        "token_budget": args.token_budget, "in_flight": args.in_flight, "writers": args.writers,
        "bytes_per_token": bytes_per_token,
    }  # fmt: skip
    save = lambda: (args.out / "extract.json").write_text(json.dumps(report, indent=2))  # noqa: E731
    log(f"machine: {report['machine']}")

    # 1. ceilings
    if device.type == "cuda":
        report["matmul"] = matmul_ceiling(device, args.sustain_seconds)
        log(f"matmul: {report['matmul']['burst']['tflops']:.1f} TFLOP/s bf16 as a burst (median), "
            f"{report['matmul']['sustained_tflops']:.1f} sustained; {report['matmul']['gpu']}")
    all_samples = make_samples(args.samples, args.mean_tokens, shape["vocab_size"])
    file_bytes = int(args.mean_tokens * bytes_per_token)
    disk = [disk_write(args.scratch, file_bytes, int(args.disk_gb * 1e9), t) for t in sorted({1, 4, args.writers})]
    report["disk_before"] = disk
    for d in disk:
        log(f"disk: {d['threads']} thread(s), {d['gb_s']:.3f} GB/s synced ({d['files']} x {d['file_bytes'] / 1e6:.1f} MB)")
    disk_gb_s = max(d["gb_s"] for d in disk)

    # size the runs: one disk-bound run of about --run-seconds, at least 48 samples
    budget_tokens = args.run_seconds * disk_gb_s * 1e9 / bytes_per_token
    samples, tokens = [], 0
    for sample in all_samples:
        if len(samples) >= 48 and tokens + len(sample.token_ids) > budget_tokens:
            break
        samples.append(sample)
        tokens += len(sample.token_ids)
    report["samples"] = length_stats(samples)
    log(f"samples: {report['samples']}")
    baseline_samples = samples[: args.baseline_samples]
    needed = 1.1 * (tokens + sum(len(s.token_ids) for s in baseline_samples)) * bytes_per_token
    if shutil.disk_usage(args.scratch).free < needed:
        raise SystemExit(f"scratch disk has {shutil.disk_usage(args.scratch).free / 1e9:.1f} GB free, needs {needed / 1e9:.1f}")

    started = time.perf_counter()
    model = build_model(args.shape, device, dtype)
    sync_device(device)
    decoder = model.get_decoder()
    decoder_params = sum(p.numel() for p in decoder.parameters())
    report["model"] = {"init_seconds": round(time.perf_counter() - started, 1), "decoder_parameters": decoder_params,
                       "embedding_parameters": decoder.get_input_embeddings().weight.numel(),
                       "lm_head_parameters": model.lm_head.weight.numel()}  # fmt: skip
    log(f"model: {report['model']}")
    if device.type == "cuda":
        flops_per_token = matmul_flops_per_token(decoder)
        heads = shape["num_attention_heads"]
        attention = attention_flops([len(s.token_ids) for s in samples], shape["num_hidden_layers"], heads, hidden // heads)
        spec = args.spec_tflops or SPEC_TFLOPS.get(report["machine"].get("gpu"))
        rates = {"sustained": report["matmul"]["sustained_tflops"], "burst": report["matmul"]["burst"]["tflops"], "spec": spec}
        report["roofline"] = {
            # the matrix products only; attention is beside it, not in it
            "flops_per_token": flops_per_token,
            "flops_per_token_with_embedding": 2 * decoder_params,  # the count before 2026-12-04, for comparison
            "attention_flops_per_token": attention / tokens,  # these samples' mean (it grows with their lengths)
            "attention_over_matmul_flops": attention / tokens / flops_per_token,
            "tflops": rates,  # spec: SPEC_TFLOPS (dense bf16, no sparsity) or --spec-tflops; None when unknown
            "compute_tok_s": rates["sustained"] * 1e12 / flops_per_token,
            "compute_burst_tok_s": rates["burst"] * 1e12 / flops_per_token,
            "compute_spec_tok_s": spec * 1e12 / flops_per_token if spec else None,
            "disk_gb_s": disk_gb_s,
            "disk_tok_s": disk_gb_s * 1e9 / bytes_per_token,
        }
        report["roofline"]["lower_tok_s"] = min(report["roofline"]["compute_tok_s"], report["roofline"]["disk_tok_s"])
        report["roofline"]["bound"] = "disk" if report["roofline"]["disk_tok_s"] < report["roofline"]["compute_tok_s"] else "compute"
        log(f"roofline: {report['roofline']}")
    save()

    # warm-up (kernels, cuBLAS handles, pinned-memory cache), not timed
    warm = make_samples(8, args.mean_tokens, shape["vocab_size"], seed=1)
    run_compute(model, warm, layer_ids, args, device)
    with torch.inference_mode():
        model(input_ids=torch.tensor([warm[0].token_ids], device=device), output_hidden_states=True)
    sync_device(device)

    runs = report.setdefault("runs", {})
    try:
        report["compute_profile"] = profile_batch(model, samples, layer_ids, args, device)
        log(f"compute profile (one batch): {report['compute_profile']}")
    except Exception as error:  # noqa: BLE001 - a profiler problem must not cost the measurements
        report["compute_profile"] = {"error": repr(error)}
    runs["compute"] = run_compute(model, samples, layer_ids, args, device)
    log(f"compute only: {runs['compute']['tok_s']:,.0f} tok/s {runs['compute']['timings']}")
    save()
    report["write_components"] = write_components(args.scratch / "components", args.mean_tokens, len(layer_ids), hidden)
    log(f"one sample's write ({args.mean_tokens} tokens): {report['write_components']}")
    runs["write"] = run_write_only(samples[: max(16, len(samples) // 8)], len(layer_ids), hidden, args.writers, args.scratch)
    for r in runs["write"].values():
        log(f"write only ({r['name']}): {r['tok_s']:,.0f} tok/s, {r['gb_s']:.3f} GB/s")
    save()

    runs["baseline"] = run_baseline(model, baseline_samples, layer_ids, device, args.scratch / "baseline")
    log(f"baseline: {runs['baseline']['tok_s']:,.0f} tok/s, {runs['baseline']['gb_s']:.3f} GB/s")
    save()
    runs["backend_eager"] = run_backend("backend_eager", model, samples, layer_ids, args, device, args.scratch / "backend_eager")
    log(f"backend, layers not compiled: {runs['backend_eager']['tok_s']:,.0f} tok/s {runs['backend_eager']['timings']}")
    shutil.rmtree(args.scratch / "backend_eager")
    save()

    started = time.perf_counter()
    compile_decoder_layers(model.get_decoder())
    run_compute(model, warm, layer_ids, args, device)
    report["compile_seconds"] = round(time.perf_counter() - started, 1)
    log(f"compiled the decoder layers in {report['compile_seconds']} s")
    try:
        report["compute_profile_compiled"] = profile_batch(model, samples, layer_ids, args, device)
        log(f"compute profile, compiled (one batch): {report['compute_profile_compiled']}")
    except Exception as error:  # noqa: BLE001
        report["compute_profile_compiled"] = {"error": repr(error)}
    runs["compute_compiled"] = run_compute(model, samples, layer_ids, args, device, name="compute_compiled")
    log(f"compute only, compiled: {runs['compute_compiled']['tok_s']:,.0f} tok/s {runs['compute_compiled']['timings']}")
    # fp8 and padded first: the default run's files stay for the correctness check (and --keep)
    run_compute(model, warm, layer_ids, args, device, padded=True)  # compiles the padded rows' graph, untimed
    for name, options in {"backend_fp8": {"storage": "fp8"}, "backend_padded": {"padded": True}}.items():
        runs[name] = run_backend(name, model, samples, layer_ids, args, device, args.scratch / name, **options)
        log(f"{name}: {runs[name]['tok_s']:,.0f} tok/s, padding {runs[name]['padding_fraction']:.1%} {runs[name]['timings']}")
        shutil.rmtree(args.scratch / name)
        save()
    runs["backend"] = run_backend("backend", model, samples, layer_ids, args, device, args.scratch / "backend")
    log(f"backend (the workflow's GPU path): {runs['backend']['tok_s']:,.0f} tok/s, {runs['backend']['gb_s']:.3f} GB/s {runs['backend']['timings']}")
    save()
    ordered = sorted(baseline_samples, key=lambda s: len(s.token_ids))
    checks = [ordered[0], ordered[len(ordered) // 2], ordered[-1]]
    report["correctness"] = compare_files(args.scratch / "backend/shard-0", args.scratch / "baseline", checks, len(layer_ids) - 1)
    log(f"correctness (backend vs batch-of-one baseline): {report['correctness']}")
    shutil.rmtree(args.scratch / "baseline")
    save()
    report["disk_after"] = [disk_write(args.scratch, file_bytes, int(args.disk_gb * 1e9), args.writers)]
    log(f"disk after: {report['disk_after'][0]['gb_s']:.3f} GB/s")

    if args.keep:
        (args.scratch / "samples.json").write_text(json.dumps(
            [{"sample_id": s.sample_id, "tokens": len(s.token_ids)} for s in samples]))  # fmt: skip
    else:
        shutil.rmtree(args.scratch / "backend")

    summary = {
        "extract_baseline_tok_s": runs["baseline"]["tok_s"],
        "extract_backend_tok_s": runs["backend"]["tok_s"],
        "extract_backend_eager_tok_s": runs["backend_eager"]["tok_s"],
        "extract_fp8_tok_s": runs["backend_fp8"]["tok_s"],
        "extract_padded_tok_s": runs["backend_padded"]["tok_s"],
        "extract_padding_fraction": runs["backend"]["padding_fraction"],
        "extract_padded_padding_fraction": runs["backend_padded"]["padding_fraction"],
        "backend_over_compute_alone": runs["backend"]["tok_s"] / runs["compute_compiled"]["tok_s"],
        "backend_eager_over_compute_alone": runs["backend_eager"]["tok_s"] / runs["compute"]["tok_s"],
        "backend_over_baseline": runs["backend"]["tok_s"] / runs["baseline"]["tok_s"],
    }
    if "roofline" in report:
        lower = report["roofline"]["lower_tok_s"]
        summary |= {
            "roofline_compute_tok_s": report["roofline"]["compute_tok_s"],
            "roofline_disk_tok_s": report["roofline"]["disk_tok_s"],
            "roofline_compute_burst_tok_s": report["roofline"]["compute_burst_tok_s"],
            "roofline_compute_spec_tok_s": report["roofline"]["compute_spec_tok_s"],
            "extract_default_over_lower_roofline": runs["backend"]["tok_s"] / lower,
            # the default over the compute roofline (matrix FLOPs only) at each rate, side by side
            "extract_default_over_compute_roofline": {
                rate: runs["backend"]["tok_s"] / report["roofline"][key] if report["roofline"][key] else None
                for rate, key in (("sustained", "compute_tok_s"), ("burst", "compute_burst_tok_s"), ("spec", "compute_spec_tok_s"))
            },
            "backend_eager_over_roofline": runs["backend_eager"]["tok_s"] / lower,
            "compute_compiled_over_compute_roofline": runs["compute_compiled"]["tok_s"] / report["roofline"]["compute_tok_s"],
        }
    report["summary"] = summary
    save()
    print("\n| run | tokens/s | GB/s | seconds |\n| --- | --- | --- | --- |")
    for r in [runs["compute"], *runs["write"].values(), *(v for k, v in runs.items() if k not in ("compute", "write"))]:
        print(f"| {r['name']} | {r['tok_s']:,.0f} | {r['gb_s']:.3f} | {r['seconds']:.1f} |")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
