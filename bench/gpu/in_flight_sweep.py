"""The default extraction (packed, compiled, ``run_shard`` with 8 writers) at several
``in_flight`` depths, beside the extractor alone: how many batches launched ahead keep
the GPU busy while the consumer waits on its writers (issue 27).

    python3 bench/gpu/in_flight_sweep.py --out $OUT            # on the GPU
"""

from __future__ import annotations

import json
import shutil

import extract_bench as bench
import torch

from draftflow.extract.transformers_backend import compile_decoder_layers


def main() -> None:
    parser = bench.sweep_parser(__doc__, "in-flight", samples=512)
    parser.add_argument("--depths", default="2,3,4", help="the in_flight depths to run (--in-flight is not read)")
    args = parser.parse_args()
    device, shape, layer_ids = bench.sweep_setup(args)
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
