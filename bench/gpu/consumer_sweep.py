"""Where the default extraction's consumer spends its time, and what hides the writes
(issue 27): the extractor alone, then ``run_shard`` end to end (packed, compiled, 8
writers) with each journal append timed, then with the journal's appends not fsynced
one by one (one fsync at the end), then that with more samples in flight.

    python3 bench/gpu/consumer_sweep.py --out $OUT            # on the GPU
"""

from __future__ import annotations

import json
import shutil
import time

import extract_bench as bench
import torch

from draftflow.extract import shards
from draftflow.extract.transformers_backend import compile_decoder_layers

APPEND = shards.ShardJournal.append
JOURNAL_S: list[float] = []


def timed_append(self, record):
    started = time.perf_counter()
    APPEND(self, record)
    JOURNAL_S.append(time.perf_counter() - started)


def unsynced_append(self, record):
    started = time.perf_counter()
    with self.path.open("a") as stream:
        stream.write(shards.layout.journal_line(record) + "\n")
    JOURNAL_S.append(time.perf_counter() - started)


def main() -> None:
    parser = bench.sweep_parser(__doc__, "consumer", samples=512)
    args = parser.parse_args()
    device, shape, layer_ids = bench.sweep_setup(args)
    samples = bench.make_samples(args.samples, args.mean_tokens, shape["vocab_size"])
    report = {"samples": bench.length_stats(samples), "machine": bench.machine_info(args.scratch, device), "runs": {}}
    bytes_per_token = len(layer_ids) * shape["hidden_size"] * 2 + 8
    report["disk"] = bench.disk_write(args.scratch, args.mean_tokens * bytes_per_token, int(args.disk_gb * 1e9), args.writers)
    bench.log(f"disk: {report['disk']['gb_s']:.3f} GB/s")
    model = bench.build_model(args.shape, device, torch.bfloat16)
    if device.type == "cuda":
        compile_decoder_layers(model.get_decoder())
    warm = bench.make_samples(8, args.mean_tokens, shape["vocab_size"], seed=1)
    bench.run_compute(model, warm, layer_ids, args, device)
    report["runs"]["compute"] = bench.run_compute(model, samples, layer_ids, args, device, name="compute_compiled")
    bench.log(f"alone: {report['runs']['compute']['tok_s']:,.0f} tok/s")
    variants = {"default": (timed_append, 2), "journal_unsynced": (unsynced_append, 2),
                "journal_unsynced_pending_8x": (unsynced_append, 8)}  # fmt: skip
    for name, (append, per_writer) in variants.items():
        shards.ShardJournal.append = append
        shards.PENDING_PER_WRITER = per_writer
        JOURNAL_S.clear()
        run = bench.run_backend(name, model, samples, layer_ids, args, device, args.scratch)
        run["journal_s"] = sum(JOURNAL_S)
        run["journal_max_s"] = max(JOURNAL_S)
        run["over_alone"] = run["tok_s"] / report["runs"]["compute"]["tok_s"]
        report["runs"][name] = run
        shutil.rmtree(args.scratch / "shard-0")
        bench.log(f"{name}: {run['tok_s']:,.0f} tok/s ({run['over_alone']:.1%} of alone), journal {run['journal_s']:.2f} s "
                  f"(max {run['journal_max_s'] * 1000:.0f} ms) {run['timings']}")  # fmt: skip
        (args.out / "consumer.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
