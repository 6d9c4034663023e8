"""``draftflow publish``: upload a drafter folder as the workflow ships it
(``results/<run>/drafter``: the drafter's files and its model card) to the Hugging Face hub.

What goes up names the target by its hub id (``--verifier``, by default the card's
``base_model`` where the target came from the hub): the drafter's ``config.json`` and the
card are rewritten in the upload, with the card's digests of the files as uploaded; the
folder and the trained drafter it links to stay as training wrote them. The token comes
from the environment (``HF_TOKEN``, or the variable ``--token-env`` names) and is never
printed; ``--dry-run`` lists what would go up and uploads nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from draftflow.model_card import CARD, drafter_files, parse_front_matter, published_card, published_config
from draftflow.units import fmt_bytes

CONFIG = "config.json"
NEEDED = (CONFIG, CARD)


class PublishError(RuntimeError):
    pass


def upload_files(folder: Path, verifier: str | None, repo_id: str) -> tuple[str, dict[str, Path | bytes]]:
    """The verifier's hub id and what the upload sends under each name: a file's path (links
    followed: the folder links to the trained drafter's), or the bytes of the config and the
    card as published."""
    if missing := [name for name in NEEDED if not (folder / name).is_file()]:
        raise PublishError(f"{folder} lacks {', '.join(missing)}: publish a drafter folder the workflow "
                           "wrote (results/<run>/drafter, made by its model_card rule)")  # fmt: skip
    card = (folder / CARD).read_text()
    base = parse_front_matter(card)["base_model"]
    verifier = verifier or (base if "/" in base else None)
    if not verifier:
        raise PublishError(f"--verifier: the target's hub id (org/name) is needed, for the drafter's config.json "
                           f"and the card to name it; the card knows it only as the local folder {base!r}")  # fmt: skip
    files: dict[str, Path | bytes] = {path.name: path.resolve() for path in drafter_files(folder) if path.name != CARD}
    config = published_config(json.loads(files[CONFIG].read_text()), verifier)
    files[CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    digests = {name: hashlib.sha256(data if isinstance(data, bytes) else data.read_bytes()).hexdigest()
               for name, data in files.items()}  # fmt: skip
    files[CARD] = published_card(card, verifier, repo_id, digests).encode()
    return verifier, dict(sorted(files.items()))


def size(data: Path | bytes) -> int:
    return len(data) if isinstance(data, bytes) else data.stat().st_size


def publish(folder: Path, repo_id: str, token_env: str, private: bool, dry_run: bool, verifier: str | None = None) -> list[str]:
    """What was (or would be) uploaded, as lines to print."""
    verifier, files = upload_files(folder, verifier, repo_id)
    token_state = "set" if os.environ.get(token_env) else "NOT set"
    lines = [f"{'would upload' if dry_run else 'uploading'} {len(files)} files, {fmt_bytes(sum(map(size, files.values())))}, "
             f"from {folder} to https://huggingface.co/{repo_id} ({'private' if private else 'public'} model repo; "
             f"verifier {verifier}; token from ${token_env}: {token_state})"]  # fmt: skip
    lines += [f"  {name}  {fmt_bytes(size(data))}{'  (as published)' if isinstance(data, bytes) else ''}"
              for name, data in files.items()]  # fmt: skip
    if dry_run:
        return lines
    if not os.environ.get(token_env):
        raise PublishError(f"${token_env} is not set: export a Hugging Face token with write access to {repo_id}")
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=os.environ[token_env])
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data if isinstance(data, bytes) else str(data))
                  for name, data in files.items()]  # fmt: skip
    commit = api.create_commit(repo_id, operations, repo_type="model", commit_message=f"draftflow: EAGLE-3 drafter for {verifier}")
    return [*lines, f"uploaded: {commit.commit_url}"]


def main(argv: list[str] | None = None, prog: str = "draftflow publish") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("folder", type=Path, help="the drafter folder, results/<run>/drafter")
    parser.add_argument("--repo-id", required=True, help="the hub repository to upload to, org/name")
    parser.add_argument("--verifier", help="the target's hub id, org/name, which the uploaded config and card name "
                        "(default: the card's base_model, where the target came from the hub)")
    parser.add_argument("--token-env", default="HF_TOKEN", help="the environment variable holding the token (HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    args = parser.parse_args(argv)
    try:
        lines = publish(args.folder, args.repo_id, args.token_env, args.private, args.dry_run, args.verifier)
    except PublishError as error:
        parser.exit(2, f"{prog}: {error}\n")
    print("\n".join(lines))
    return 0
