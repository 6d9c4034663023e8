"""Response tokens per second of one vLLM engine on a target of Llama-3.1-8B's shape (issue 58):
the rate the plan's CUDA default for generation scales from.

A decoder's speed does not depend on what its weights say, so the target is Llama-3.1-8B's
config with random weights (built on the GPU, written as safetensors; no download). vLLM
serves it as the generate rule's server does (bfloat16, CUDA graphs and torch.compile); each
round sends CONCURRENCY requests of --prompt-tokens random ids and takes --max-tokens answer
tokens from each (``ignore_eos``: every answer is as long), so a round's requests finish
together and tokens/s is the round's answer tokens over its time. Prints and writes JSON.

    python bench/gpu/generation_rate.py --model /tmp/llama-8b-shape --build   # the target (its own process:
    python bench/gpu/generation_rate.py --model /tmp/llama-8b-shape --out rate.json  # vLLM's engine wants CUDA untouched)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# Llama-3.1-8B's config.json, the fields that set its cost (MEASURED_EXTRACTION's shape)
LLAMA_8B_SHAPE = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip


def build(out: Path) -> dict:
    """A random Llama of LLAMA_8B_SHAPE in bfloat16, written to ``out`` (about 16 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_8B_SHAPE))
    model.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters()), "build_s": round(time.perf_counter() - started, 1)}


def measure(model: Path, concurrencies: list[int], prompt_tokens: int, max_tokens: int, rounds: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=max(concurrencies),
              max_model_len=prompt_tokens + max_tokens, seed=0)  # fmt: skip
    result = {"device": torch.cuda.get_device_name(), "engine_start_s": round(time.perf_counter() - started, 1), "prompt_tokens": prompt_tokens,
              "max_tokens": max_tokens, "by_concurrency": {}}  # fmt: skip
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    ids = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list:
        drawn = torch.randint(0, LLAMA_8B_SHAPE["vocab_size"], (count, prompt_tokens), generator=ids)
        return [TokensPrompt(prompt_token_ids=row.tolist()) for row in drawn]

    llm.generate(prompts(4), SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))  # warm-up
    for concurrency in concurrencies:
        seconds, tokens = 0.0, 0
        for _ in range(rounds):
            batch = prompts(concurrency)
            begun = time.perf_counter()
            outputs = llm.generate(batch, sampling, use_tqdm=False)
            seconds += time.perf_counter() - begun
            tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
        result["by_concurrency"][str(concurrency)] = {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}
        print(concurrency, result["by_concurrency"][str(concurrency)], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--build", action="store_true", help="write the random target to --model, and stop")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    if options.build:
        print(json.dumps(build(options.model)))
        return
    report = {"shape": LLAMA_8B_SHAPE, **measure(options.model, options.concurrency, options.prompt_tokens, options.max_tokens, options.rounds)}
    options.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
