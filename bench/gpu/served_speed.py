"""Tokens per second a user gets from vLLM with and without a run's drafter (issue 58).

The same prompts (the run's held-out and MT-Bench samples, as serve_check sends them) are
served twice by the workflow's own server flags: once plain, once with the drafter
(``--speculative-config``), each greedily, one request at a time (latency, what a chat
user sees) and then all at once (a batch). Prints and writes JSON: tokens, seconds and
tokens/s per way, and the speed-up.

    python bench/gpu/served_speed.py --run-dir RUN_FOLDER --configfile CONFIG... --out speed.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftflow.config import load_config
from draftflow.evaluate import GREEDY, evaluation_samples
from draftflow.serve_check import complete, served_acceptance, served_prompts, spec_decode_counters, speculative_args
from draftflow.vllm_server import server_env, target_server_args, vllm_server


def timed(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda ids: complete(url, model, ids, max_tokens, GREEDY), prompts))
    seconds = time.perf_counter() - started
    return {"requests": len(prompts), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def measure(model: str, args: list[str], env: dict, log: Path, prompts: list[list[int]], max_tokens: int, draft_tokens: int) -> dict:
    with vllm_server(model, args, log, health_timeout_s=900, env=env) as url:
        timed(url, model, prompts[:4], max_tokens, 4)  # warm-up: compile and graph capture done before timing
        before = spec_decode_counters(url)
        result = {"one_at_a_time": timed(url, model, prompts, max_tokens, 1), "all_at_once": timed(url, model, prompts, max_tokens, len(prompts))}
        after = spec_decode_counters(url)
    counters = {key: value - before.get(key, 0.0) for key, value in after.items()}
    if counters:
        result["acceptance"] = served_acceptance(counters, draft_tokens)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--run-dir", type=Path, default=Path("."), help="the workflow's directory")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, help="the first N prompts only (default: all)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--graphs", action="store_true", help="leave out the config's --enforce-eager: CUDA graphs and compile, as served")
    options = parser.parse_args()
    config = load_config(*options.configfile)
    results = options.run_dir / "results" / config["run"]
    model = str((options.run_dir / config["target"]["path"]).resolve())
    views = results / "training_data"
    by_set = {**evaluation_samples(views / "heldout"), **evaluation_samples(views / "evaluation")}
    prompts = [ids for groups in served_prompts(by_set).values() for group in groups.values() for ids in group][: options.prompts]
    args = target_server_args(config["vllm"], dtype=config["target"]["dtype"], device=config["device"], seed=config["seed"],
                              trust_remote_code=config["target"]["trust_remote_code"])  # fmt: skip
    if options.graphs:
        args = [arg for arg in args if arg != "--enforce-eager"]
    env = server_env(config["vllm"], config["device"])
    draft_tokens = config["evaluate"]["draft_tokens"]
    drafter = results / "drafter_trained"  # what serve_check serves (train.output.drafter)
    logs = options.out.parent
    report = {
        "prompts": len(prompts),
        "max_tokens": options.max_tokens,
        "draft_tokens": draft_tokens,
        "plain": measure(model, args, env, logs / "speed-plain.server.log", prompts, options.max_tokens, draft_tokens),
        "drafter": measure(model, [*args, *speculative_args(drafter, draft_tokens)], env, logs / "speed-drafter.server.log",
                           prompts, options.max_tokens, draft_tokens),  # fmt: skip
    }
    for way in ("one_at_a_time", "all_at_once"):
        report[f"speedup_{way}"] = round(report["drafter"][way]["tokens_per_s"] / report["plain"][way]["tokens_per_s"], 3)
    options.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
