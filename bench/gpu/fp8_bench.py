"""fp8 hidden-state storage against full precision on one GPU (issue 15).

On the machine it runs on: the bf16 matrix rate and the disk's synced write
bandwidth (the ceilings), then the workflow's GPU path (``run_shard`` with the
compiled transformers extractor, files written on --writers threads, each
hashed, fsynced, renamed and journaled, ``os.sync()`` at the end) over the same
samples in ``extract.storage`` full (bf16) and fp8, in the order full, fp8,
fp8, full; the mean of each storage's two runs is reported beside its disk
roofline (disk bandwidth over its bytes per token) and the compute roofline.
Last, the fp8 files are read back through speculators' ``FP8Transfer`` (over
a folder of view links, ``hs_<row>`` -> the shard's ``hs_<sample id>``, as a
training view has them) and compared with the bf16 files of the same samples
(the fidelity check's measure: max |difference| over max |bf16 value|, per
layer slot).

    python3 bench/gpu/fp8_bench.py --shape 8b --out $OUT          # on the GPU
    .venv/bin/python bench/gpu/fp8_bench.py --shape tiny --device cpu --samples 24 --mean-tokens 200 --run-seconds 2
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

import extract_bench as bench
import torch
from hs_connectors import FP8Transfer
from safetensors.torch import load_file

from draftflow.extract.fidelity import relative_errors
from draftflow.extract.hidden_states import STORAGES
from draftflow.extract import layout
from draftflow.extract.layout import hidden_state_bytes
from draftflow.extract.transformers_backend import compile_decoder_layers

def main() -> None:
    parser = bench.sweep_parser(__doc__, "fp8", samples=256)
    parser.add_argument("--run-seconds", type=float, default=15.0, help="size the samples so that one bf16 disk-bound run takes about this long")
    args = parser.parse_args()
    device, shape, layer_ids = bench.sweep_setup(args)
    per_token = {s: hidden_state_bytes(1, len(layer_ids), shape["hidden_size"], args.dtype, s) - hidden_state_bytes(
        0, len(layer_ids), shape["hidden_size"], args.dtype, s) for s in STORAGES}  # fmt: skip
    report: dict = {"machine": bench.machine_info(args.scratch, device), "shape": {"name": args.shape, **shape},
                    "layer_ids": layer_ids, "bytes_per_token": per_token, "writers": args.writers}  # fmt: skip
    save = lambda: (args.out / "fp8.json").write_text(json.dumps(report, indent=2))  # noqa: E731
    if device.type == "cuda":
        report["matmul"] = bench.matmul_ceiling(device, sustain_seconds=10)
    disk = bench.disk_write(args.scratch, int(args.mean_tokens * per_token["full"]), int(args.disk_gb * 1e9), args.writers)
    report["disk"] = disk
    bench.log(f"disk: {disk['gb_s']:.3f} GB/s synced, {args.writers} threads")
    budget = args.run_seconds * disk["gb_s"] * 1e9 / per_token["full"]
    samples, tokens = [], 0
    for sample in bench.make_samples(args.samples, args.mean_tokens, shape["vocab_size"]):
        if len(samples) >= 32 and tokens + len(sample.token_ids) > budget:
            break
        samples.append(sample)
        tokens += len(sample.token_ids)
    report["samples"] = bench.length_stats(samples)
    model = bench.build_model(args.shape, device, torch.bfloat16)
    flops_per_token = bench.matmul_flops_per_token(model.get_decoder())
    compile_decoder_layers(model.get_decoder())
    warm = bench.make_samples(8, args.mean_tokens, shape["vocab_size"], seed=1)
    for storage in STORAGES:  # compiles and warms both paths, not timed
        bench.run_backend(f"warm_{storage}", model, warm, layer_ids, args, device, args.scratch / "warm", storage=storage)
        shutil.rmtree(args.scratch / "warm")
    runs = report.setdefault("runs", [])
    for attempt, storage in enumerate(("full", "fp8", "fp8", "full")):
        keep = attempt < 2  # the first run of each storage keeps its files for the comparison
        directory = args.scratch / f"{storage}-{attempt}"
        run = bench.run_backend(f"{storage}_{attempt}", model, samples, layer_ids, args, device, directory, storage=storage)
        runs.append(run | {"storage": storage})
        bench.log(f"{storage}: {run['tok_s']:,.0f} tok/s, {run['gb_s']:.3f} GB/s, {run['bytes'] / run['tokens']:.1f} bytes/token")
        if not keep:
            shutil.rmtree(directory)
        save()
    full_dir, fp8_dir = args.scratch / "full-0/shard-0", args.scratch / "fp8-1/shard-0"
    # FP8Transfer reads hs_<row>, as in a training view: link the rows to the shard's files
    links = args.scratch / "fp8-view"
    links.mkdir()
    compared = samples[:8]
    for row, sample in enumerate(compared):
        (links / layout.view_file_name(row)).symlink_to((fp8_dir / layout.file_name(sample.sample_id)).resolve())
    reader = FP8Transfer(links, dequantize_dtype=torch.float32)
    worst = [0.0] * len(layer_ids)
    for row, sample in enumerate(compared):
        reference = load_file(full_dir / layout.file_name(sample.sample_id))["hidden_states"]
        read = reader.get_cached(row)["hidden_states"]
        worst = [max(w, e) for w, e in zip(worst, relative_errors(reference, read), strict=True)]
    report["fp8_vs_bf16_max_relative_error_per_layer"] = dict(zip(map(str, layer_ids), worst, strict=True))
    mean = {s: statistics.mean(r["tok_s"] for r in runs if r["storage"] == s) for s in STORAGES}
    measured_bytes = {s: statistics.mean(r["bytes"] / r["tokens"] for r in runs if r["storage"] == s) for s in STORAGES}
    summary = {
        "extract_bf16_tok_s": mean["full"], "extract_fp8_tok_s": mean["fp8"], "fp8_over_bf16": mean["fp8"] / mean["full"],
        "bytes_per_token_bf16": measured_bytes["full"], "bytes_per_token_fp8": measured_bytes["fp8"],
        "fp8_bytes_over_bf16": measured_bytes["fp8"] / measured_bytes["full"],
        "disk_gb_s": disk["gb_s"],
        "roofline_disk_bf16_tok_s": disk["gb_s"] * 1e9 / per_token["full"],
        "roofline_disk_fp8_tok_s": disk["gb_s"] * 1e9 / per_token["fp8"],
    }  # fmt: skip
    if device.type == "cuda":
        summary["roofline_compute_tok_s"] = report["matmul"]["sustained_tflops"] * 1e12 / flops_per_token
    report["summary"] = summary
    save()
    shutil.rmtree(args.scratch, ignore_errors=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    bench.log(f"done in {time.perf_counter() - started:.0f} s")
