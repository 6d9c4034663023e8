"""How evaluation weighs drafts at real sizes (issue 57): time and peak memory of the target's
probabilities of the drafted tokens over one answer, the whole-vocabulary way evaluation took
before (the [positions x vocabulary] logits at once, a softmax of them, vLLM's top-k/top-p cut on
all of them) against ``draftflow.evaluate.acceptance_probability`` (a chunk of positions at a
time, a log-sum-exp and a gather).

A synthetic head of a real shape (Qwen3's 151,936-token vocabulary, hidden 4,096) over an
answer of 8,192 positions, K = 7 drafts, at temperature 0 and at temperature 1 with top_k 20
(and top_p 0.95 where vLLM is installed: its cut needs it; without vLLM the whole way cuts top_k
as draftflow does, by each row's k-th value, on every row at once). Each case runs in a process of its
own; peak memory is that process's largest resident set on the CPU (the weights and states
included, reported apart) and torch's largest allocation on CUDA. The two ways' probabilities
are compared on every case both finish.

    .venv/bin/python bench/evaluate_bench.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time

import torch

from draftflow.evaluate import POSITION_CHUNK, acceptance_probability, cut_logits, verifying_positions

SAMPLINGS = {"temperature 0": {"temperature": 0}, "temperature 1, top_k 20": {"temperature": 1.0, "top_k": 20},
             "temperature 1, top_k 20, top_p 0.95": {"temperature": 1.0, "top_k": 20, "top_p": 0.95}}  # fmt: skip


def inputs(vocab: int, hidden: int, positions: int, k: int, device: str):
    generator = torch.Generator().manual_seed(0)
    head = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(device)
    states = torch.randn(positions, hidden, generator=generator).to(device)
    drafts = torch.randint(0, vocab, (k, positions - 1), generator=generator)
    return head, states, drafts


def whole_vocabulary(head, states, drafts, sampling) -> torch.Tensor:
    """Evaluation before issue 57: every position's logits at once, softmaxed and cut whole."""
    logits = states @ head.T
    positions = verifying_positions(drafts)
    inside = positions < logits.shape[0]
    positions = positions.clamp(max=logits.shape[0] - 1).to(logits.device)
    if sampling["temperature"] == 0:
        return ((drafts.to(logits.device) == logits.argmax(-1)[positions]).float() * inside.to(logits.device)).cpu()
    if importlib.util.find_spec("vllm"):  # what evaluation called
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        rows = logits.shape[0]
        top_k, top_p = sampling.get("top_k"), sampling.get("top_p")
        cut = apply_top_k_top_p(logits / sampling["temperature"], torch.full((rows,), top_k, device=logits.device) if top_k else None,
                                torch.full((rows,), top_p, device=logits.device) if top_p else None)  # fmt: skip
    else:  # a machine without vLLM (the GPU machines lent here): the same top_k cut, on every row at once
        cut = cut_logits(logits, sampling)
    return (cut.softmax(-1)[positions, drafts.to(logits.device)] * inside.to(logits.device)).cpu()


def chunked(head, states, drafts, sampling) -> torch.Tensor:
    return acceptance_probability(lambda a, b: states[a:b] @ head.T, states.shape[0], drafts, sampling)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_case(args) -> dict:
    """The case ``args`` names, in this process: seconds, peak bytes, the probabilities' sum."""
    head, states, drafts = inputs(args.vocab, args.hidden, args.positions, args.k, args.device)
    before = peak_bytes(args.device)
    started = time.perf_counter()
    probabilities = {"whole": whole_vocabulary, "chunked": chunked}[args.way](head, states, drafts, SAMPLINGS[args.sampling])
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    torch.save(probabilities, args.save)
    return {"seconds": seconds, "peak_bytes": peak_bytes(args.device), "inputs_bytes": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--out")
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--sampling", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one_case(args)))
        return
    samplings = [name for name, s in SAMPLINGS.items() if "top_p" not in s or importlib.util.find_spec("vllm")]
    shape = f"vocabulary {args.vocab:,}, hidden {args.hidden:,}, {args.positions:,} positions, K {args.k}, chunk {POSITION_CHUNK}"
    print(f"{args.device}: {shape}\n| sampling | way | seconds | peak memory (GiB) | of it the inputs (GiB) |\n| --- | --- | --- | --- | --- |")
    results = {"device": args.device, "shape": shape, "cases": []}
    for sampling in samplings:
        found = {}
        for way in ("whole", "chunked"):
            save = f"/tmp/evaluate_bench-{way}.pt"
            command = [sys.executable, __file__, *sys.argv[1:], "--way", way, "--sampling", sampling, "--save", save]
            process = subprocess.run(command, capture_output=True, text=True)
            if process.returncode:
                case = {"sampling": sampling, "way": way, "failed": f"exit {process.returncode} (-9: killed, out of memory)",
                        "error": process.stderr.strip().splitlines()[-1:]}  # fmt: skip
                print(f"| {sampling} | {way} | {case['failed']} | | |")
            else:
                case = {"sampling": sampling, "way": way, **json.loads(process.stdout.strip().splitlines()[-1])}
                found[way] = torch.load(save)
                print(f"| {sampling} | {way} | {case['seconds']:.2f} | {case['peak_bytes'] / 2**30:.2f} | {case['inputs_bytes'] / 2**30:.2f} |")
            results["cases"].append(case)
        if len(found) == 2:
            difference = float((found["whole"] - found["chunked"]).abs().max())
            results["cases"][-1]["largest_difference_from_whole"] = difference
            print(f"|   largest difference of a probability, chunked against whole: {difference:.2e} | | | | |")
    if args.out:
        with open(args.out, "w") as stream:
            json.dump(results, stream, indent=2)


if __name__ == "__main__":
    main()
