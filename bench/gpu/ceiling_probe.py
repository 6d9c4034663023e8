"""What bounds the compiled extractor at the 8B shape (issue 27): the matrix rate the
GPU sustains, the rate of the layer's own products, and what compilation modes give
a decoder over packed samples.

1. ``ceiling``: 8192^3 bf16 products timed one by one (extract_bench's figure: a
   burst of 20) and back to back for --sustain-seconds, with nvidia-smi's SM clock,
   power and clock-event reasons sampled meanwhile; the rate in each second;
2. ``products``: each projection of a Llama-3.1-8B layer at --tokens tokens (q, k, v,
   o, gate, up, down; fused qkv and gate_up), back to back, with cuBLAS and cuBLASLt;
3. ``decoder``: a decoder of the 8B shape with --layers layers over one packed batch
   of --tokens tokens (samples of the extraction benchmark's lengths), as the
   extractor runs it: eager; compiled as ``extract.compile`` does (dynamic shapes);
   compiled with static shapes; compiled with max-autotune (static shapes);
4. ``attention`` (not run by default): the packed attention's kernels at the 8B
   shape over the same batch: PyTorch's varlen flash kernel (the extractor's, kv
   heads copied), the same kernel given the kv heads as they are, FlexAttention with
   a document mask and cuDNN's varlen attention, alone (TFLOP/s, error against
   float32 SDPA per sample) and, but cuDNN's, inside the compiled decoder; and the
   decoder with attention skipped, which bounds what any attention kernel could gain.

    python3 bench/gpu/ceiling_probe.py --out $OUT        # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import extract_bench as bench
import torch

from draftflow.extract import packed_attention


def timed(run, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls, CUDA events around each."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times


PRODUCTS = {  # (in, out) of the 8B layer's projections
    "q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
    "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096),
    "qkv_fused": (4096, 6144), "gate_up_fused": (4096, 28672),
}  # fmt: skip


def products(device, tokens: int) -> dict:
    out = {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        rates = {}
        for name, (d_in, d_out) in PRODUCTS.items():
            x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16)
            w = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16)
            flops = 2 * tokens * d_in * d_out
            reps = max(5, int(0.5 * 700e12 / flops))
            run = lambda: [torch.nn.functional.linear(x, w) for _ in range(reps)]  # noqa: E731
            run()
            rates[name] = flops * reps / statistics.median(timed(run, 3)) / 1e12
        separate = ["q", "k", "v", "o", "gate", "up", "down"]
        layer_flops = {n: 2 * tokens * PRODUCTS[n][0] * PRODUCTS[n][1] for n in PRODUCTS}
        seconds = lambda names: sum(layer_flops[n] / (rates[n] * 1e12) for n in names)  # noqa: E731
        rates["layer_separate"] = sum(layer_flops[n] for n in separate) / seconds(separate) / 1e12
        fused = ["qkv_fused", "o", "gate_up_fused", "down"]
        rates["layer_fused"] = sum(layer_flops[n] for n in fused) / seconds(fused) / 1e12
        out[library] = rates
        bench.log(f"products, {library}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def packed_batch(tokens: int, vocab: int) -> list[list[int]]:
    """Samples of extract_bench's lengths, taken in order until ``tokens`` is reached."""
    samples, total = [], 0
    for sample in bench.make_samples(256, 2000, vocab, seed=2):
        n = min(len(sample.token_ids), tokens - total)
        if n <= 0:
            break
        samples.append(sample.token_ids[:n])
        total += n
    return samples


def decoder_modes(device, tokens: int, layers: int, reps: int, only: str | None = None) -> dict:
    from transformers import LlamaConfig, LlamaModel

    shape = {**bench.SHAPES["8b"], "num_hidden_layers": layers}
    torch.manual_seed(0)
    with torch.device(device):
        decoder = LlamaModel(LlamaConfig(**shape)).to(torch.bfloat16).eval()
    packed_attention.use_packed_attention(decoder.config)
    batch = packed_batch(tokens, shape["vocab_size"])
    lengths = [len(s) for s in batch]
    inputs = {
        "input_ids": torch.tensor([t for s in batch for t in s], device=device)[None],
        "position_ids": packed_attention.position_ids(lengths).to(device),
        "use_cache": False,
        **packed_attention.packed_keywords(packed_attention.sample_offsets(lengths), device),
    }
    # FLOPs the roofline counts per token: the matrix products' (the embedding is a lookup)
    layer_params = sum(p.numel() for p in decoder.layers.parameters())
    flops_per_token = bench.matmul_flops_per_token(decoder)
    eager_forwards = [layer.forward for layer in decoder.layers]
    modes = {
        "eager": None,
        "compiled_dynamic": {"dynamic": True},  # extract.compile
        "compiled_static": {"dynamic": False},
        "compiled_static_max_autotune": {"dynamic": False, "mode": "max-autotune-no-cudagraphs"},
    }
    out = {"tokens": sum(lengths), "samples": len(lengths), "layers": layers, "layer_parameters": layer_params}
    for name, options in modes.items():
        if only is not None and name != only:
            continue
        torch._dynamo.reset()
        for layer, forward in zip(decoder.layers, eager_forwards):
            layer.forward = forward if options is None else torch.compile(forward, **options)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                run = lambda: decoder(**inputs)  # noqa: E731
                run()
                torch.cuda.synchronize(device)
                warm_s = time.perf_counter() - started
                times = timed(run, reps)
        except Exception as error:  # noqa: BLE001 - one mode failing must not cost the others
            out[name] = {"error": repr(error)[:500]}
            bench.log(f"decoder {name}: {error!r}"[:500])
            continue
        seconds = statistics.median(times)
        out[name] = {"first_call_s": round(warm_s, 1), "seconds": seconds, "spread": [min(times), max(times)],
                     "tok_s_per_layer_stack": sum(lengths) / seconds,
                     "layer_tflops": flops_per_token * sum(lengths) / seconds / 1e12,
                     # tokens/s of the 32 layers of the 8B shape at this rate
                     "tok_s_8b": sum(lengths) / seconds * layers / 32}  # fmt: skip
        bench.log(f"decoder {name}: {out[name]}")
    return out


def cudnn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **_causal):
    """``varlen_attn``'s call (causal, heads expanded) on cuDNN's varlen attention."""
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, True, False, scale=scale
    )[0]


def flash_native_gqa(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **_causal):
    """The flash kernel itself, given k and v with their own (fewer) heads: FlashAttention-2
    shares each kv head among its query heads, so they need no copies."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


_FLEX = {}  # the batch's block mask, built once from its sample offsets


def flex_documents(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, **_causal):
    """FlexAttention over the packed row: causal within each sample (a document mask),
    whole blocks outside the samples skipped; kv heads shared (enable_gqa)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "mask" not in _FLEX:
        bounds = cu_q.tolist()
        document = torch.repeat_interleave(
            torch.arange(len(bounds) - 1, device=q.device), torch.tensor(bounds).diff().to(q.device)
        )
        same_sample_causal = lambda b, h, qi, ki: (document[qi] == document[ki]) & (qi >= ki)  # noqa: E731
        _FLEX["mask"] = create_block_mask(same_sample_causal, None, None, q.shape[0], q.shape[0], device=q.device)
        _FLEX["attend"] = torch.compile(flex_attention)
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    out = _FLEX["attend"](*heads_first, block_mask=_FLEX["mask"], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def no_attention(q, k, v, *args, **kwargs):
    return q


# name: (the function packed_attention calls as varlen_attn, whether it takes k and v unexpanded)
ATTENTION_KERNELS = {
    "flash": (packed_attention.varlen_attn, packed_attention.VARLEN_GQA),
    "flash_native_gqa": (flash_native_gqa, True),
    "cudnn": (cudnn_varlen, False),
    "flex": (flex_documents, True),
    "skipped": (no_attention, True),
}


def use_kernel(name: str) -> None:
    packed_attention.varlen_attn, packed_attention.VARLEN_GQA = ATTENTION_KERNELS[name]


def attention_kernels(device, tokens: int, layers: int, reps: int) -> dict:
    """Each kernel alone on the batch's q, k, v, then in the compiled decoder."""
    heads, kv_heads, dim = 32, 8, 128
    lengths = [len(s) for s in packed_batch(tokens, 128256)]
    offsets = packed_attention.sample_offsets(lengths)
    keywords = packed_attention.packed_keywords(offsets, device)
    torch.manual_seed(0)
    q = torch.randn(sum(lengths), heads, dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), kv_heads, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    expanded = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v)]
    flops = bench.attention_flops(lengths, 1, heads, dim)  # one layer's
    cu, longest = keywords["cu_seq_lens_q"], keywords["max_length_q"]
    first = list(zip(offsets[:4], offsets[1:5]))
    reference = [
        torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1).float()[None] for t in (q, *expanded)), is_causal=True
        )[0].transpose(0, 1)
        for a, b in first
    ]
    out = {"tokens": sum(lengths), "samples": len(lengths), "flops": flops, "alone": {}, "decoder": {}}
    for name in ("flash", "flash_native_gqa", "flex", "cudnn"):
        kernel, native_gqa = ATTENTION_KERNELS[name]
        kv = (k, v) if native_gqa else expanded
        try:
            run = lambda: kernel(q, *kv, cu, cu, longest, longest, scale=dim**-0.5, **packed_attention.VARLEN_CAUSAL)  # noqa: E731
            result = run()
            error = max(
                ((result[a:b].float() - ref).abs().max() / ref.abs().max()).item() for (a, b), ref in zip(first, reference)
            )
            seconds = statistics.median(timed(run, reps))
            out["alone"][name] = {"seconds": seconds, "tflops": flops / seconds / 1e12, "max_rel_error_vs_fp32": error}
        except Exception as error:  # noqa: BLE001
            out["alone"][name] = {"error": repr(error)[:500]}
        bench.log(f"attention alone, {name}: {out['alone'][name]}")
    for name in ("flash", "flash_native_gqa", "flex", "skipped"):
        use_kernel(name)
        out["decoder"][name] = decoder_modes(device, tokens, layers, reps, only="compiled_dynamic")["compiled_dynamic"]
    use_kernel("flash")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sustain-seconds", type=float, default=20)
    parser.add_argument("--tokens", type=int, default=32768, help="extract.token_budget (the schema's default)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--parts", default="ceiling,products,decoder")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", bench.REPO / "bench/results")))
    args = parser.parse_args()
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": bench.machine_info(args.out, device), "tokens": args.tokens}
    parts = args.parts.split(",")
    save = lambda: (args.out / "ceiling.json").write_text(json.dumps(report, indent=2))  # noqa: E731
    if "ceiling" in parts:
        report["ceiling"] = bench.matmul_ceiling(device, args.sustain_seconds)
        c = report["ceiling"]
        bench.log(f"ceiling: burst {c['burst']['tflops']:.0f}, sustained {c['sustained_tflops']:.0f} TFLOP/s; {c['gpu']}")
        save()
    if "products" in parts:
        report["products"] = products(device, args.tokens)
        save()
    if "decoder" in parts:
        report["decoder"] = decoder_modes(device, args.tokens, args.layers, args.reps)
        save()
    if "attention" in parts:
        report["attention"] = attention_kernels(device, args.tokens, args.layers, args.reps)
        save()
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1)[-6000:])


if __name__ == "__main__":
    main()
