"""Acceptance as the tests hold runs to it (issue 43): measured numbers per class of host, and
vLLM's counters against the evaluation's decoding replay.

CPU training and vLLM's CPU kernels round differently per vendor and instruction set (MKL and
oneDNN dispatch on both), so a drafter's acceptance repeats to three decimals on one class of
host and not across classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# The flags past torch's capability that change which kernels oneDNN runs in 16 bits
ROUNDING_FLAGS = ("avx512_bf16", "amx_bf16")
SPREAD = 0.02  # between runs on one class of host: the same to three decimals where run twice


def cpu_flags() -> tuple[str, set[str]]:
    """The vendor and the flags of the first processor in /proc/cpuinfo."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields.get("vendor_id", "unknown"), set(fields.get("flags", "").split())


def host_class() -> str:
    """E.g. ``AuthenticAMD AVX512+avx512_bf16``: the vendor, torch's CPU capability and the
    rounding flags the processor has."""
    vendor, flags = cpu_flags()
    return " ".join([vendor, "+".join([torch.backends.cpu.get_cpu_capability(), *(f for f in ROUNDING_FLAGS if f in flags)])])


def assert_measured_acceptance(run: Path, measured: dict[str, dict], name: str, recorded_in: str) -> None:
    """The run's (offline, served) mean acceptance lengths are what ``measured[host class][name]``
    recorded, within SPREAD; on a class with none recorded, fail saying how to record them."""
    host = host_class()
    if host not in measured:
        pytest.fail(f"No acceptance is recorded for host class {host!r}: run this test twice on this host and, "
                    f"where both runs give the same (offline, served) mean acceptance lengths, add them for {name!r} "
                    f"under {host!r} in {recorded_in}")  # fmt: skip
    recorded = measured[host][name]
    evaluation = json.loads((run / "evaluation/evaluation.json").read_text())
    served_file = run / "evaluation/served.json"
    got = (evaluation["trained"]["mean_acceptance_length"],
           json.loads(served_file.read_text())["mean_acceptance_length"] if served_file.exists() else None)  # fmt: skip
    # a list: hosts of the class measured different values, each reproducible on its host
    assert any(matches(got, pair) for pair in (recorded if isinstance(recorded, list) else [recorded])), (got, host)


def matches(got: tuple, recorded: tuple) -> bool:
    (offline, served), (recorded_offline, recorded_served) = got, recorded
    same_served = served is None if recorded_served is None else served == pytest.approx(recorded_served, rel=SPREAD)
    return offline == pytest.approx(recorded_offline, rel=SPREAD) and same_served


def assert_served_as_replayed(run: Path) -> dict:
    """At temperature 0 the evaluation's decoding replay predicts vLLM's counters: the same
    drafts, and the same accepted tokens but for the last step of each request, whose drafts past
    the answer's last greedy token the replay cannot check (K - 2 of them at most). The replay."""
    evaluation = json.loads((run / "evaluation/evaluation.json").read_text())
    served = json.loads((run / "evaluation/served.json").read_text())
    replay = evaluation["trained"]["decoding_replay"]
    assert replay["requests"] == served["requests"] and replay["drafts"] == served["drafts"], (replay, served)
    unchecked = served["accepted_tokens"] - replay["accepted_tokens"]
    assert 0 <= unchecked <= replay["requests"] * max(evaluation["draft_tokens"] - 2, 0), (replay, served)
    return replay
