"""``draftflow publish``: upload a drafter folder as the workflow ships it
(``results/<run>/drafter``: the drafter's files and its model card) to the Hugging Face hub.

The token comes from the environment (``HF_TOKEN``, or the variable ``--token-env`` names)
and is never printed; ``--dry-run`` lists what would go up and uploads nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from draftflow.model_card import CARD, drafter_files, parse_front_matter
from draftflow.units import fmt_bytes

NEEDED = ("config.json", CARD)


class PublishError(RuntimeError):
    pass


def upload_files(folder: Path) -> list[tuple[str, int]]:
    """The files the upload sends (links followed: the folder links to the trained drafter's)."""
    if missing := [name for name in NEEDED if not (folder / name).is_file()]:
        raise PublishError(f"{folder} lacks {', '.join(missing)}: publish a drafter folder the workflow "
                           "wrote (results/<run>/drafter, made by its model_card rule)")  # fmt: skip
    return [(path.name, path.stat().st_size) for path in drafter_files(folder)]


def publish(folder: Path, repo_id: str, token_env: str, private: bool, dry_run: bool) -> list[str]:
    """What was (or would be) uploaded, as lines to print."""
    files = upload_files(folder)
    base = parse_front_matter((folder / CARD).read_text()).get("base_model")
    token_state = "set" if os.environ.get(token_env) else "NOT set"
    lines = [f"{'would upload' if dry_run else 'uploading'} {len(files)} files, {fmt_bytes(sum(s for _, s in files))}, "
             f"from {folder} to https://huggingface.co/{repo_id} ({'private' if private else 'public'} model repo; "
             f"base model {base}; token from ${token_env}: {token_state})"]  # fmt: skip
    lines += [f"  {name}  {fmt_bytes(size)}" for name, size in files]
    if dry_run:
        return lines
    if not os.environ.get(token_env):
        raise PublishError(f"${token_env} is not set: export a Hugging Face token with write access to {repo_id}")
    from huggingface_hub import HfApi

    api = HfApi(token=os.environ[token_env])
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", ignore_patterns=[".*"],
                               commit_message=f"draftflow: EAGLE-3 drafter for {base}")  # fmt: skip
    return [*lines, f"uploaded: {commit.commit_url}"]


def main(argv: list[str] | None = None, prog: str = "draftflow publish") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("folder", type=Path, help="the drafter folder, results/<run>/drafter")
    parser.add_argument("--repo-id", required=True, help="the hub repository to upload to, org/name")
    parser.add_argument("--token-env", default="HF_TOKEN", help="the environment variable holding the token (HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    args = parser.parse_args(argv)
    try:
        lines = publish(args.folder, args.repo_id, args.token_env, args.private, args.dry_run)
    except PublishError as error:
        parser.exit(2, f"{prog}: {error}\n")
    print("\n".join(lines))
    return 0
