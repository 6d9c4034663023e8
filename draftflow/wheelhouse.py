"""A wheelhouse: the CUDA set as wheels for a GPU node that has no package index (issue 58).

Three steps, each one command (docs/install.md):

1. on the node: ``python3 -m draftflow.wheelhouse describe > node.json`` (standard library
   only): its Python, platform, C library and the packages it has, torch among them;
2. where the index is reachable: ``make wheelhouse NODE=node.json`` resolves pyproject's
   CUDA set for that node with pip (its Python, its platform tags, binary wheels only) with
   torch held at the node's release and vLLM left free, so that pip takes the newest vLLM
   built for that torch (vLLM pins one torch per release: torch 2.11.0 -> vllm 0.26.0), and
   downloads what the node lacks into ``wheelhouse/``; ``wheelhouse.json`` records the set;
3. on the node: ``make install DEVICE=cuda WHEELHOUSE=wheelhouse`` installs those wheels
   without an index and without their dependencies, beside the node's own packages.

What the node has is kept, whatever version the resolution chose (its torch above all:
a CUDA build that matches its driver); ``wheelhouse.json`` lists where the two differ.
Packages vLLM imports only on paths draftflow never takes are left out (OPTIONAL).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import venv
from importlib import metadata
from pathlib import Path

from draftflow import locks  # the standard library only, as `describe` on the node needs

# What vLLM declares but imports only where draftflow never goes (read in vllm 0.26.0's
# source, 2026-12-05: lazily, or behind an availability check): 560 MB of the 917 MB set.
OPTIONAL = {
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell MLA and FP4 paths)",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL kernels",
    "nvidia-cutlass-dsl-libs-core": "CuTe DSL kernels",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL kernels",
    "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL kernels",
    "quack-kernels": "CuTe DSL kernels",
    "humming-kernels": "quantized MoE kernels",
    "tokenspeed-mla": "MLA decode kernels (DeepSeek-style targets)",
    "tokenspeed-triton": "MLA decode kernels",
    "tilelang": "TileLang kernels",
    "z3-solver": "TileLang's solver",
    "pynvvideocodec": "video inputs",
    "torchcodec": "video inputs",
    "nvidia-cuda-nvcc": "flashinfer's JIT compiler: the node's CUDA toolkit serves",
    "nvidia-cuda-crt": "flashinfer's JIT compiler",
    "nvidia-cuda-nvdisasm": "flashinfer's JIT compiler",
    "nvidia-cuda-cccl": "flashinfer's JIT compiler",
    "nvidia-nvvm": "flashinfer's JIT compiler",
}
# Published as source only: built into a wheel here (pure Python), at the CPU lock's version.
SOURCE_ONLY = ("connection-pool",)
OLDEST_MANYLINUX = 17  # manylinux_2_17 (manylinux2014): the oldest glibc wheels still target


def describe() -> dict:
    """This machine as the wheelhouse needs it: Python, platform, glibc, its distributions."""
    libc, libc_version = platform.libc_ver()
    return {
        "python": "%d.%d" % sys.version_info[:2],
        "machine": platform.machine(),
        "libc": f"{libc} {libc_version}".strip(),
        "packages": {locks.canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]},
    }


def platform_tags(node: dict) -> list[str]:
    """The wheel platform tags the node's C library takes, newest first."""
    libc, _, version = node["libc"].partition(" ")
    if libc != "glibc" or not version:
        raise SystemExit(f"the node's C library is {node['libc']!r}: wheels for glibc (manylinux) only")
    newest = int(version.split(".")[1])
    machine = node["machine"]
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(newest, OLDEST_MANYLINUX - 1, -1)]
    return [*tags, f"manylinux2014_{machine}", f"linux_{machine}"]


def requirements_for(node: dict) -> list[str]:
    """pyproject's CUDA set, torch at the node's release and vLLM free to follow it."""
    torch = node["packages"].get("torch")
    if torch is None:
        raise SystemExit("the node has no torch: install its CUDA build there first (it must match the node's driver)")
    release = torch.split("+")[0]
    pinned = {"torch": f"torch=={release}", "vllm": "vllm"}
    return [pinned.get(locks.canonical(re.split(r"[=<>!~ ]", line)[0]), line) for line in locks.direct_requirements("cuda")]


def build_source_only(folder: Path) -> None:
    pins = locks.read_lock(locks.lock_path("cpu"))
    for name in SOURCE_ONLY:
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), f"{name}=={pins[name]}"],
                               capture_output=True, text=True, env=locks.default_index_environment())  # fmt: skip
        if built.returncode != 0:
            raise SystemExit(f"cannot build {name}'s wheel:\n{built.stderr[-2000:]}")


def resolve(node: dict, requirements: list[str], find_links: Path, *options: str) -> list[dict]:
    """pip's resolution of ``requirements`` for the node (a dry run): name, version, URL each."""
    tags = [arg for tag in platform_tags(node) for arg in ("--platform", tag)]
    with tempfile.TemporaryDirectory() as tmp:
        installs = locks.dry_run_report(["--only-binary=:all:", "--python-version", node["python"], "--implementation", "cp", *tags,
                                         "--target", tmp, "--find-links", str(find_links), *options, *requirements])  # fmt: skip
    return [{"name": locks.canonical(item["metadata"]["name"]), "version": item["metadata"]["version"],
             "url": item["download_info"]["url"]} for item in installs]  # fmt: skip


def plan(node: dict, resolved: list[dict]) -> dict:
    """What to carry, what the node keeps (and where its version differs), what is left out."""
    have = node["packages"]
    carried = [item for item in resolved if item["name"] not in have and item["name"] not in OPTIONAL]
    kept = {item["name"]: {"node": have[item["name"]], "resolved": item["version"]} for item in resolved if item["name"] in have}
    return {
        "carried": {item["name"]: item["version"] for item in carried},
        "kept_differing": {name: versions for name, versions in kept.items() if versions["node"].split("+")[0] != versions["resolved"]},
        "left_out": {item["name"]: OPTIONAL[item["name"]] for item in resolved if item["name"] in OPTIONAL and item["name"] not in have},
        "urls": [item["url"] for item in carried],
    }


def download(urls: list[str], folder: Path) -> None:
    """Each wheel by the URL pip resolved (a local one, built here, is already in ``folder``)."""
    for url in urls:
        if url.startswith("file:"):
            continue
        name = url.rsplit("/", 1)[1].split("#")[0]
        if not (folder / name).exists():
            subprocess.run(["curl", "-sSfL", "--retry", "3", "-o", str(folder / f".{name}.part"), url], check=True)
            (folder / f".{name}.part").replace(folder / name)


def make(node_file: Path, folder: Path) -> dict:
    node = json.loads(node_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    build_source_only(folder)
    # the data packages without their dependencies, as the locks carry them (nothing of them is imported)
    resolved = resolve(node, requirements_for(node), folder) + resolve(node, locks.data_packages(), folder, "--no-deps")
    contents = plan(node, resolved)
    download(contents.pop("urls"), folder)
    record = {"node": {key: node[key] for key in ("python", "machine", "libc")}, "torch": node["packages"]["torch"], **contents}
    (folder / "wheelhouse.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def node_venv(folder: Path) -> None:
    """A venv whose packages come first and this interpreter's environment's after them (a
    ``.pth`` file): the node's torch and CUDA libraries stay where they are, whether that
    environment is the system's or a venv of its own (``--system-site-packages`` reaches
    only the base interpreter's)."""
    venv.create(folder, with_pip=True)
    own = Path(sysconfig.get_paths(vars={"base": str(folder), "platbase": str(folder)})["purelib"])
    node = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (own / "_node_packages.pth").write_text("".join(f"{path}\n" for path in node))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftflow.wheelhouse", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("describe", help="print this machine (run it on the GPU node) as JSON")
    made = commands.add_parser("make", help="resolve and download the wheels a described node lacks")
    made.add_argument("--node", type=Path, required=True, help="the JSON `describe` printed on the node")
    made.add_argument("--out", type=Path, default=Path("wheelhouse"))
    beside = commands.add_parser("venv", help="make a venv beside this interpreter's packages (run it with the node's Python)")
    beside.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "describe":
        print(json.dumps(describe(), indent=1))
        return
    if args.command == "venv":
        node_venv(args.folder)
        return
    try:
        record = make(args.node, args.out)
    except locks.LockError as error:
        sys.exit(str(error))
    size = sum(path.stat().st_size for path in args.out.glob("*.whl"))
    print(f"{args.out}: {len(record['carried'])} wheels, {size / 2**20:.0f} MiB, for Python {record['node']['python']} "
          f"with torch {record['torch']} (vllm {record['carried'].get('vllm', 'kept from the node')})")  # fmt: skip
    for name, versions in record["kept_differing"].items():
        print(f"  kept the node's {name} {versions['node']} (the set resolved {versions['resolved']})")


if __name__ == "__main__":
    main()
