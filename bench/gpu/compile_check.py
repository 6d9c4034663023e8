"""Compiled against eager against float32, on weights with trained structure (issue 27).

Random weights say little about how compiled kernels round: their activations
grow layer by layer without bound. This script trains a Llama of Llama-3.2-1B's
decoder shape (hidden 2,048, 16 layers, 32 heads, 8 KV heads, intermediate
8,192; the vocabulary is bytes) on the machine, for --train-seconds, on the
Python sources installed there (nothing is downloaded), then extracts held-out
sources three ways with draftflow's ``TransformersExtractor``: float32 eager
(the reference), bfloat16 eager, bfloat16 with the decoder layers compiled
(``extract.compile``). The same comparison runs on the untrained weights first.

Two measures per layer slot, the maximum over samples: the fidelity rule's
(max |difference| over max |reference|, ``draftflow.extract.fidelity``) and the
relative Frobenius norm ||difference|| / ||reference||.

    python3 bench/gpu/compile_check.py --out $OUT                       # on the GPU
    .venv/bin/python bench/gpu/compile_check.py --shape tiny --device cpu --train-seconds 5 --samples 4  # smoke test
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1])]

from draftflow.extract.fidelity import relative_errors  # noqa: E402
from draftflow.extract.layout import Sample  # noqa: E402
from draftflow.extract.transformers_backend import TransformersExtractor, compile_decoder_layers  # noqa: E402
from draftflow.layers import resolve_layer_ids  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2),
}  # fmt: skip


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def python_sources(limit_bytes: int) -> tuple[bytes, bytes]:
    """The installed Python sources, split by a hash of each path: 95% to train on, 5% held out."""
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], *sys.path[1:]})
    train, held_out, total = [], [], 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")) if Path(root).is_dir() else []:
            try:
                text = path.read_bytes()
            except OSError:
                continue
            bucket = held_out if hashlib.sha256(str(path).encode()).digest()[0] < 13 else train
            bucket.append(text)
            total += len(text)
            if total >= limit_bytes:
                return b"\n".join(train), b"\n".join(held_out)
    return b"\n".join(train), b"\n".join(held_out)


def train(model, data: torch.Tensor, seconds: float, seq: int, batch: int, device) -> dict:
    """AdamW, linear warm-up then cosine, bf16 autocast, random windows of the sources."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    losses, step, started = [], 0, time.perf_counter()
    expected_steps = None
    while (elapsed := time.perf_counter() - started) < seconds:
        if step == 5:
            expected_steps = max(20, int(seconds / (elapsed / 5)))
        total = expected_steps or 1000
        warmup = max(1, total // 20)
        lr = 6e-4 * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=window[:, :-1], labels=window[:, 1:].contiguous(), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 20 == 0 or step == 1:
            losses.append((step, round(loss.item(), 4)))
            log(f"step {step}: loss {losses[-1][1]:.3f} (nats per byte), lr {lr:.2e}")
    return {"steps": step, "seconds": round(time.perf_counter() - started, 1), "tokens": step * batch * seq,
            "losses": losses}  # fmt: skip


def held_out_samples(data: torch.Tensor, count: int, mean_tokens: int, longest: int) -> list[Sample]:
    """Lognormal lengths, none longer than the windows the model was trained on."""
    generator = torch.Generator().manual_seed(1)
    sigma = 0.6
    lengths = torch.exp(math.log(mean_tokens) - sigma**2 / 2 + sigma * torch.randn(count, generator=generator))
    samples, start = [], 0
    for index, length in enumerate(lengths.round().clamp(64, longest).int().tolist()):
        samples.append(Sample(index, f"held-out-{index}", data[start : start + length].tolist()))
        start += length
    return samples


def extract(model, samples, layer_ids, device) -> dict[str, torch.Tensor]:
    extractor = TransformersExtractor(model, layer_ids, token_budget=32768, device=str(device))
    try:
        return {sample.sample_id: states.float().clone() for sample, states in extractor(samples)}
    finally:
        extractor.close()


def worst_errors(reference: dict, other: dict) -> dict:
    fidelity, frobenius = None, None
    for sample_id, ref in reference.items():
        got = other[sample_id]
        slots = relative_errors(ref, got)
        norms = [float((got[:, k] - ref[:, k]).norm() / ref[:, k].norm().clamp_min(1e-12)) for k in range(ref.shape[1])]
        fidelity = slots if fidelity is None else [max(a, b) for a, b in zip(fidelity, slots, strict=True)]
        frobenius = norms if frobenius is None else [max(a, b) for a, b in zip(frobenius, norms, strict=True)]
    return {"fidelity_measure": fidelity, "relative_frobenius": frobenius,
            "max_fidelity_measure": max(fidelity), "max_relative_frobenius": max(frobenius)}  # fmt: skip


def compare_modes(model, samples, layer_ids, device) -> dict:
    """float32 eager (reference), bf16 eager, bf16 compiled: the errors of each against the others."""
    reference = extract(copy.deepcopy(model).float(), samples, layer_ids, device)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    eager = extract(bf16, samples, layer_ids, device)
    started = time.perf_counter()
    compile_decoder_layers(bf16.get_decoder())
    compiled = extract(bf16, samples, layer_ids, device)
    compile_s = time.perf_counter() - started
    del bf16
    result = {
        "eager_vs_fp32": worst_errors(reference, eager),
        "compiled_vs_fp32": worst_errors(reference, compiled),
        "compiled_vs_eager": worst_errors(eager, compiled),
        "compile_and_extract_seconds": round(compile_s, 1),
        "activation_max_abs_per_slot": [max(float(r[:, k].abs().max()) for r in reference.values())
                                        for k in range(len(layer_ids))],  # fmt: skip
    }
    for name in ("eager_vs_fp32", "compiled_vs_fp32", "compiled_vs_eager"):
        log(f"  {name}: fidelity measure {result[name]['max_fidelity_measure']:.4f}, "
            f"relative norm {result[name]['max_relative_frobenius']:.4f}")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--train-seconds", type=float, default=200)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--mean-tokens", type=int, default=1000)
    parser.add_argument("--source-bytes", type=int, default=400_000_000)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE.parents[1] / "bench/results")))
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    save = lambda: (args.out / "compile_check.json").write_text(json.dumps(report, indent=2))  # noqa: E731

    train_bytes, held_out_bytes = python_sources(args.source_bytes)
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    held_out = torch.frombuffer(bytearray(held_out_bytes), dtype=torch.uint8).long()
    report["data"] = {"train_bytes": len(data), "held_out_bytes": len(held_out)}
    log(f"data: {report['data']}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, max_position_embeddings=8192, tie_word_embeddings=True, **SHAPES[args.shape])
    with torch.device(device):
        model = LlamaForCausalLM(config)
    report["shape"] = {"name": args.shape, **SHAPES[args.shape], "parameters": sum(p.numel() for p in model.parameters())}
    layer_ids = resolve_layer_ids(None, config.num_hidden_layers)
    samples = held_out_samples(held_out, args.samples, args.mean_tokens, args.seq)
    report["layer_ids"], report["samples"] = layer_ids, {"count": len(samples), "tokens": sum(len(s.token_ids) for s in samples)}
    log(f"shape {report['shape']}, layer ids {layer_ids}, samples {report['samples']}")

    log("untrained (random) weights:")
    model.eval()
    report["random"] = compare_modes(model, samples, layer_ids, device)
    save()
    model.train()
    report["training"] = train(model, data, args.train_seconds, args.seq, args.batch, device)
    save()
    model.eval()
    log("trained weights:")
    report["trained"] = compare_modes(model, samples, layer_ids, device)
    trained = report["trained"]
    report["summary"] = {
        "compiled_vs_eager_max_rel_error_trained": trained["compiled_vs_eager"]["max_relative_frobenius"],
        "compiled_vs_fp32_max_rel_error_trained": trained["compiled_vs_fp32"]["max_relative_frobenius"],
        "eager_vs_fp32_max_rel_error_trained": trained["eager_vs_fp32"]["max_relative_frobenius"],
        "compiled_vs_fp32_fidelity_measure_trained": trained["compiled_vs_fp32"]["max_fidelity_measure"],
        "eager_vs_fp32_fidelity_measure_trained": trained["eager_vs_fp32"]["max_fidelity_measure"],
        "compiled_vs_eager_max_rel_error_random": report["random"]["compiled_vs_eager"]["max_relative_frobenius"],
    }
    save()
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
