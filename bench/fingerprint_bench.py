"""How fast a target's weights are hashed, and what an unchanged target costs after (issue 60).

Writes a target of FILES weight files of GIB GiB each (a safetensors header, then random
bytes) in a temporary folder, dated an hour back as a downloaded target is, and deletes it
after. Then, with an empty draftflow cache:

- the first hash, the files dropped from the page cache first (fsync, then
  ``posix_fadvise(DONTNEED)``): the disk's read and sha256 together, what a new target costs;
- the hash again from the page cache (the cache's entries deleted): sha256 alone;
- ``dependencies.target_identities`` of the unchanged target (the model, tokenizer and whole
  target identities Snakemake's parse computes), best of 5: a ``stat`` per file.

    .venv/bin/python bench/fingerprint_bench.py [--files 3] [--gib 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from draftflow.dependencies import target_identities
from draftflow.fingerprint import WEIGHT_DIGESTS, target_fingerprint
from draftflow.vllm_registry import CACHE_DIR_ENV

BLOCK = 64 << 20
HOUR_NS = 3600 * 10**9


def write_weights(path: Path, size: int, block: bytes) -> None:
    """A safetensors file of one uint8 tensor of ``size`` bytes, written to the disk and
    dropped from the page cache, its mtime an hour back."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as stream:
        stream.write(len(header).to_bytes(8, "little") + header)
        for start in range(0, size, len(block)):
            stream.write(block[: size - start])
        stream.flush()
        os.fsync(stream.fileno())
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mtime = path.stat().st_mtime_ns - HOUR_NS
    os.utime(path, ns=(mtime, mtime))


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(target: Path, cache: Path) -> dict:
    total = sum(path.stat().st_size for path in target.glob("*.safetensors"))
    cold = timed(lambda: target_fingerprint(target))
    shutil.rmtree(cache / WEIGHT_DIGESTS)
    warm = timed(lambda: target_fingerprint(target))
    cached = min(timed(lambda: target_identities(target)) for _ in range(5))
    return {
        "bytes": total,
        "first_hash_s": round(cold, 2),
        "first_hash_mb_per_s": round(total / cold / 1e6),
        "page_cache_hash_s": round(warm, 2),
        "page_cache_hash_mb_per_s": round(total / warm / 1e6),
        "cached_identities_ms": round(cached * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each weight file")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the target is written")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fingerprint-bench-", dir=args.dir))
    try:
        target, cache = work / "target", work / "cache"
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
        block = os.urandom(BLOCK)
        for k in range(args.files):
            write_weights(target / f"model-{k + 1:05d}-of-{args.files:05d}.safetensors", int(args.gib * (1 << 30)), block)
        os.environ[CACHE_DIR_ENV] = str(cache)
        print(json.dumps({"files": args.files, **measure(target, cache)}, indent=2))
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
