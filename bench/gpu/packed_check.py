"""Packed batches against each sample alone on the GPU, in bf16 and fp32 (issue 27).

A Llama with random weights (GQA, 4 layers) extracts samples of mixed lengths
(1 to 999 tokens) in one packed batch with ``TransformersExtractor``; each
sample's states are compared with transformers' ``output_hidden_states`` of
the sample alone (relative Frobenius norm per layer id). It also says which
attention kernel the packed path runs with the installed torch.

    python3 bench/gpu/packed_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1])]

from draftflow.extract import packed_attention  # noqa: E402
from draftflow.extract.layout import Sample  # noqa: E402
from draftflow.extract.transformers_backend import TransformersExtractor  # noqa: E402

LAYER_IDS = [1, 2, 4]
LENGTHS = [300, 17, 1, 128, 999, 64]


def errors_against_each_alone(model, samples, device) -> dict[str, list[float]]:
    extractor = TransformersExtractor(model, LAYER_IDS, 32768, str(device))
    got = {sample.sample_id: states.float().clone() for sample, states in extractor(samples)}
    assert extractor.timings["batches"] == 1 and extractor.timings["padded_tokens"] == sum(LENGTHS)
    extractor.close()
    errors = {}
    with torch.inference_mode():
        for sample in samples:
            hidden = model(torch.tensor([sample.token_ids], device=device), output_hidden_states=True).hidden_states
            states = got[sample.sample_id]
            errors[sample.sample_id] = [
                float((states[:, slot] - hidden[k][0].float().cpu()).norm() / hidden[k][0].float().norm().clamp_min(1e-12))
                for slot, k in enumerate(LAYER_IDS[:-1])
            ]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE.parents[1] / "bench/results")))
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    samples = [Sample(i, f"s{i}", torch.randint(0, 1000, (n,), generator=generator).tolist()) for i, n in enumerate(LENGTHS)]
    report = {
        "torch": torch.__version__,
        "varlen_parameters": list(packed_attention.VARLEN_PARAMETERS),
        "varlen_gqa": packed_attention.VARLEN_GQA,
        "varlen_causal": {k: list(v) if isinstance(v, tuple) else v for k, v in packed_attention.VARLEN_CAUSAL.items()},
    }
    for dtype in (torch.bfloat16, torch.float32):
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
        errors = errors_against_each_alone(model, samples, device)
        report[str(dtype)] = {"max_relative_error": max(max(e) for e in errors.values()), "per_sample": errors}
        print(dtype, "max relative error against each sample alone:", report[str(dtype)]["max_relative_error"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packed_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
