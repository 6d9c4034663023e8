"""The offline install's wheelhouse (issue 58): what a described node gets, and the venv that
keeps the node's own packages. The resolution against the index ran by hand
(`make wheelhouse`, BENCHMARKS.md); here, what is decided from its answer."""

import json
import subprocess
import sys

import pytest

from draftflow import wheelhouse

NODE = {"python": "3.12", "machine": "x86_64", "libc": "glibc 2.39",
        "packages": {"torch": "2.11.0+cu130", "numpy": "2.5.2", "fastapi": "0.136.3"}}  # fmt: skip


def test_the_node_description_is_this_interpreter_and_its_packages():
    node = wheelhouse.describe()
    assert node["python"] == "%d.%d" % sys.version_info[:2]
    assert node["packages"]["pytest"] == pytest.__version__
    assert json.loads(json.dumps(node)) == node  # what `describe` prints is what `make` reads


def test_the_platform_tags_follow_the_nodes_glibc_newest_first():
    tags = wheelhouse.platform_tags(NODE)
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_40_x86_64" not in tags
    assert tags.index("manylinux_2_28_x86_64") < tags.index("manylinux_2_17_x86_64")
    with pytest.raises(SystemExit, match="musl"):
        wheelhouse.platform_tags({**NODE, "libc": "musl 1.2"})


def test_torch_is_held_at_the_nodes_release_and_vllm_left_to_follow_it():
    requirements = wheelhouse.requirements_for(NODE)
    assert "torch==2.11.0" in requirements and "vllm" in requirements
    assert not any(line.startswith(("torch==2.14", "vllm==")) for line in requirements)
    with pytest.raises(SystemExit, match="no torch"):
        wheelhouse.requirements_for({**NODE, "packages": {}})


def test_the_node_keeps_what_it_has_and_optional_packages_stay_behind():
    resolved = [
        {"name": "torch", "version": "2.11.0", "url": "https://files/torch.whl"},
        {"name": "numpy", "version": "2.3.5", "url": "https://files/numpy.whl"},
        {"name": "fastapi", "version": "0.136.3", "url": "https://files/fastapi.whl"},
        {"name": "vllm", "version": "0.26.0", "url": "https://files/vllm.whl"},
        {"name": "tilelang", "version": "0.1.9", "url": "https://files/tilelang.whl"},
    ]
    plan = wheelhouse.plan(NODE, resolved)
    assert plan["carried"] == {"vllm": "0.26.0"} and plan["urls"] == ["https://files/vllm.whl"]
    assert plan["kept_differing"] == {"numpy": {"node": "2.5.2", "resolved": "2.3.5"}}  # torch's +cu130 is the same release
    assert list(plan["left_out"]) == ["tilelang"]


def test_the_venv_sees_its_creators_packages_after_its_own(tmp_path):
    wheelhouse.node_venv(tmp_path / "venv")
    probe = "import pytest, sys; print(pytest.__file__); print(sys.prefix)"
    lines = subprocess.run([tmp_path / "venv/bin/python", "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert lines[0].startswith(sys.prefix) and lines[1] == str(tmp_path / "venv")  # found in the creator's environment
