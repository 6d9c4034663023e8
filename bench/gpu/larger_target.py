"""The demo's target, larger, trained on the GPU: the demo's tokenizer, conversations and
prompts, a Llama of ``--hidden-size`` (1024: 115M parameters, the demo's 128 gives 2.5M), so
that a GPU run of the workflow (bench/gpu/larger_gpu.sh) keeps the GPU busy with a target
that answers as the demo's does (issue 58). Prints what it built as JSON.

    python bench/gpu/larger_target.py --out resources/larger-target --prompts resources/larger-prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# torch's deterministic algorithms on CUDA (demo.target trains under them) need cuBLAS's fixed workspace
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from demo.target import build_demo_target, write_demo_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True  # the target's own training: speed, not bit-exactness
    built = build_demo_target(options.out, train_steps=options.steps, learning_rate=options.lr,
                              hidden_size=options.hidden_size, device=options.device)  # fmt: skip
    write_demo_prompts(options.prompts, count=300, seed=0)
    print(json.dumps({**built, "hidden_size": options.hidden_size, "device": options.device}))


if __name__ == "__main__":
    main()
