"""The default extraction (packed, compiled, ``run_shard`` with 8 writers) at several
``in_flight`` depths, beside the extractor alone: how many batches launched ahead keep
the GPU busy while the consumer waits on its writers (issue 27).

    python3 bench/gpu/in_flight_sweep.py --out $OUT            # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import extract_bench as bench
import torch

from draftflow.extract.transformers_backend import compile_decoder_layers
from draftflow.layers import resolve_layer_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--mean-tokens", type=int, default=2000)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--depths", default="2,3,4")
    parser.add_argument("--scratch", type=Path, default=bench.REPO / ".bench-scratch/in-flight")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", bench.REPO / "bench/results")))
    args = parser.parse_args()
    args.dtype = "bfloat16"
    device = torch.device(args.device)
    shutil.rmtree(args.scratch, ignore_errors=True)
    args.scratch.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = bench.SHAPES[args.shape]
    layer_ids = resolve_layer_ids(None, shape["num_hidden_layers"])
    samples = bench.make_samples(args.samples, args.mean_tokens, shape["vocab_size"])
    report = {"samples": bench.length_stats(samples), "machine": bench.machine_info(args.scratch, device), "runs": {}}
    if device.type == "cuda":
        report["matmul"] = bench.matmul_tflops(device)
    model = bench.build_model(args.shape, device, torch.bfloat16)
    compile_decoder_layers(model.get_decoder())
    warm = bench.make_samples(8, args.mean_tokens, shape["vocab_size"], seed=1)
    for depths in [int(d) for d in args.depths.split(",")]:
        args.in_flight = depths
        bench.run_compute(model, warm, layer_ids, args, device)
        alone = bench.run_compute(model, samples, layer_ids, args, device, name=f"compute_in_flight_{depths}")
        backend = bench.run_backend(f"backend_in_flight_{depths}", model, samples, layer_ids, args, device, args.scratch)
        shutil.rmtree(args.scratch / "shard-0")
        report["runs"][depths] = {"compute": alone, "backend": backend, "backend_over_compute": backend["tok_s"] / alone["tok_s"]}
        bench.log(f"in_flight {depths}: alone {alone['tok_s']:,.0f}, end to end {backend['tok_s']:,.0f} tok/s "
                  f"({backend['tok_s'] / alone['tok_s']:.1%}) {backend['timings']}")  # fmt: skip
        (args.out / "in_flight.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
