"""`draftflow publish` uploads the drafter naming its target by the hub id (issue 59): the
config and the card are rewritten in what goes up, never in the run's folder."""

import hashlib
import json
import shlex
from pathlib import Path

import pytest

from draftflow.model_card import CARD, digest_line, drafter_note, parse_front_matter, serve_command, title
from draftflow.publish import PublishError, main, upload_files

TARGET = "/models/Qwen3-8B"
CONFIG = {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": 64,
          "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": TARGET}}}  # fmt: skip


def drafter_folder(tmp_path: Path, base_model: str) -> Path:
    """A run's drafter folder as model_card writes it: links to the trained files, and a card
    in the card's own format (front matter, title, serve command, digests)."""
    trained, drafter = tmp_path / "drafter_trained", tmp_path / "drafter"
    trained.mkdir(parents=True)
    drafter.mkdir()
    (trained / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    (trained / "model.safetensors").write_bytes(b"weights" * 100)
    for name in ("config.json", "model.safetensors"):
        (drafter / name).symlink_to(f"../drafter_trained/{name}")
    settings = {"target": {"path": TARGET}, "draft_tokens": 3, "server_args": ["--max-model-len", "4096"]}
    digests = [digest_line(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(trained.iterdir())]
    card = ["---", f"base_model: {base_model}", "library_name: speculators", "---", "", title(base_model), "",
            serve_command(settings, "results/run/drafter"), "", drafter_note("results/run/drafter"), "", *digests, ""]  # fmt: skip
    (drafter / CARD).write_text("\n".join(card))
    return drafter


def test_the_upload_names_the_target_by_its_hub_id_and_leaves_the_run_as_trained(tmp_path):
    drafter = drafter_folder(tmp_path, "Qwen3-8B")
    before = {p.name: p.read_bytes() for p in (tmp_path / "drafter_trained").iterdir()} | {CARD: (drafter / CARD).read_bytes()}
    verifier, files = upload_files(drafter, "Qwen/Qwen3-8B", "me/qwen3-8b-eagle3")
    assert verifier == "Qwen/Qwen3-8B" and set(files) == {"config.json", "model.safetensors", CARD}
    config = json.loads(files["config.json"])
    assert config["speculators_config"]["verifier"] == {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"}
    assert {k: v for k, v in config.items() if k != "speculators_config"} == {k: v for k, v in CONFIG.items() if k != "speculators_config"}
    assert files["model.safetensors"] == (tmp_path / "drafter_trained/model.safetensors").resolve()  # sent as trained
    card = files[CARD].decode()
    assert parse_front_matter(card) == {"base_model": "Qwen/Qwen3-8B", "library_name": "speculators"}
    assert title("Qwen/Qwen3-8B") in card.splitlines() and "(`me/qwen3-8b-eagle3` is this repository.)" in card
    command = shlex.split(next(line for line in card.splitlines() if line.startswith("vllm serve ")))
    assert command[2] == "Qwen/Qwen3-8B" and command[3:5] == ["--max-model-len", "4096"]
    assert json.loads(command[-1]) == {"model": "me/qwen3-8b-eagle3", "method": "eagle3", "num_speculative_tokens": 3}
    for name in ("config.json", "model.safetensors"):
        data = files[name] if isinstance(files[name], bytes) else files[name].read_bytes()
        assert digest_line(name, hashlib.sha256(data).hexdigest()) in card.splitlines()
    assert {p.name: p.read_bytes() for p in (tmp_path / "drafter_trained").iterdir()} | {CARD: (drafter / CARD).read_bytes()} == before


def test_the_verifier_defaults_to_a_hub_base_model_and_is_asked_for_otherwise(tmp_path, capsys):
    hub, local = (drafter_folder(tmp_path / name, base) for name, base in (("hub", "Qwen/Qwen3-8B"), ("local", "Qwen3-8B")))
    assert upload_files(hub, None, "me/x")[0] == "Qwen/Qwen3-8B"
    with pytest.raises(PublishError, match="--verifier: the target's hub id .* the local folder 'Qwen3-8B'"):
        upload_files(local, None, "me/x")
    with pytest.raises(SystemExit) as refused:
        main([str(local), "--repo-id", "me/x", "--dry-run"])
    assert refused.value.code == 2 and "--verifier" in capsys.readouterr().err
    assert main([str(local), "--repo-id", "me/x", "--verifier", "Qwen/Qwen3-8B", "--dry-run"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "would upload 3 files" in listed[0] and "verifier Qwen/Qwen3-8B" in listed[0]
    assert [line.split()[0] for line in listed[1:]] == [CARD, "config.json", "model.safetensors"]
    assert listed[2].endswith("(as published)") and not listed[3].endswith("(as published)")
