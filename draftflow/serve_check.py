"""Serve the target with the trained drafter in vLLM and read its own acceptance counters."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftflow.vllm_server import vllm_server

COUNTER = re.compile(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})? ([0-9.e+]+)$")


def speculative_args(drafter: Path, draft_tokens: int) -> list[str]:
    config = {"model": str(drafter.resolve()), "method": "eagle3", "num_speculative_tokens": draft_tokens}
    return ["--speculative-config", json.dumps(config)]


def spec_decode_counters(base_url: str) -> dict[str, float]:
    """Sum each spec-decode counter over engines; per-position ones keyed by position."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if match := COUNTER.match(line):
            name, labels, value = match.groups()
            position = re.search(r'position="(\d+)"', labels or "")
            key = f"{name}[{position.group(1)}]" if position else name
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


def complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int) -> int:
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


def served_acceptance(counters: dict[str, float], draft_tokens: int) -> dict:
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_position = [
        counters.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{k}]", 0.0) / drafts if drafts else 0.0
        for k in range(draft_tokens)
    ]
    return {
        "drafts": drafts,
        "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        "accepted_tokens": accepted,
        "acceptance_per_position": per_position,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
    }


def serve_check(
    target: str, drafter: Path, prompts: list[list[int]], draft_tokens: int, max_tokens: int, server: dict, log_path: Path
) -> dict:
    args = [*server["args"], *speculative_args(drafter, draft_tokens)]
    with vllm_server(target, log_path=log_path, **{**server, "args": args}) as url:
        with ThreadPoolExecutor(8) as pool:
            generated = sum(pool.map(lambda ids: complete(url, target, ids, max_tokens), prompts))
        result = served_acceptance(spec_decode_counters(url), draft_tokens)
    return {"requests": len(prompts), "generated_tokens": generated, **result}
