"""Print a finished run's acceptance figures with the host that measured them, as a row of
BENCHMARKS.md's "Acceptance per host" table.

CPU training and vLLM's CPU kernels round differently per vendor and instruction set, so a
drafter's acceptance repeats exactly on one host and not across hosts: the tests hold runs to
what every host must show (tests/acceptance.py), and the figures each host measured are kept
here, never in an assertion.

    .venv/bin/python bench/acceptance_record.py results/demo [results/twin-qwen3_moe ...]
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

ROUNDING_FLAGS = ("avx512_bf16", "amx_bf16")  # past torch's capability, they change oneDNN's 16-bit kernels


def host() -> str:
    """E.g. ``AMD EPYC (AuthenticAMD AVX512+avx512_bf16)``: the processor's name, vendor, torch's
    CPU capability and the rounding flags it has."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    capability = "+".join([torch.backends.cpu.get_cpu_capability(), *(f for f in ROUNDING_FLAGS if f in flags)])
    return f"{fields.get('model name', platform.processor())} ({fields.get('vendor_id', 'unknown')} {capability})"


def row(run: Path) -> str:
    evaluation = json.loads((run / "evaluation/evaluation.json").read_text())
    served_path = run / "evaluation/served.json"
    served = json.loads(served_path.read_text()) if served_path.exists() else None
    replay = evaluation["trained"]["decoding_replay"]
    return " | ".join([
        "", run.name, host(),
        f"{evaluation['trained']['mean_acceptance_length']:.3f}",
        f"{evaluation['untrained']['mean_acceptance_length']:.3f}",
        f"{replay['mean_acceptance_length']:.3f} ({replay['drafts']} drafts, {replay['accepted_tokens']} accepted)",
        f"{served['mean_acceptance_length']:.3f} ({served['drafts']:.0f} drafts, {served['accepted_tokens']:.0f} accepted)" if served else "not served",
        "",
    ]).strip()  # fmt: skip


if __name__ == "__main__":
    print("| run | host | offline, every position | untrained | decoding replay | served by vLLM |")
    for folder in sys.argv[1:]:
        print(row(Path(folder)))
