"""`pretrain push DIR --repo ORG/NAME`: publish a folder that `pretrain export --format hf` wrote on the
Hugging Face Hub, where users keep the models their tools read: one model repo, one commit of every file.

Why a command of our own rather than `hf upload`: it checks that DIR is an export (config.json and its
weights) before anything else, so a wrong directory is refused before any network call; it creates the repo
(private on request) and the branch a --revision names; and every failure a user can fix (no token, a repo
name the Hub refuses, a connection refused, an HTTP error) is one line and exit 2.

The token is HF_TOKEN, else the login cache (`hf auth login`), found by huggingface_hub's own lookup. It
goes to the Hub client and nowhere else: never printed, never logged, and cut out of any error message this
command shows or raises. `--dry-run` lists what would be uploaded (files, sizes, total, target repo and
revision) and needs neither a token nor a network.

Progress: huggingface_hub draws its own progress bars while it uploads (HF_HUB_DISABLE_PROGRESS_BARS=1
hides them); this command says what it is about to send first, and where it went last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.errors import UserError

DEFAULT_REVISION = "main"
# The weights in the repo that a push replaces: the ones it does not upload are deleted in its commit, so an
# export that went from one file to shards (or back) never leaves the repo with two sets.
WEIGHTS = ["*.safetensors", "*.safetensors.index.json"]
REPO_RULE = (
    "a Hub repo is ORG/NAME, each part at most 96 letters, digits, '-', '_' or '.', starting and ending "
    "with a letter, digit or '_', with no '--' or '..' and not ending in '.git'"
)
LOGIN_HINT = "set HF_TOKEN to a token with write access, or run `hf auth login`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir", metavar="DIR", help="a folder written by `pretrain export RUN_DIR --output DIR --format hf`"
    )
    p.add_argument(
        "--repo",
        required=True,
        metavar="ORG/NAME",
        help="the model repo on the Hub (ORG is your user name or an organization); created if missing",
    )
    p.add_argument(
        "--private",
        action="store_true",
        help="create the repo private (without it: public, unless the organization's default is private); "
        "an existing repo keeps its visibility",
    )
    p.add_argument(
        "--revision",
        metavar="R",
        default=DEFAULT_REVISION,
        help="the branch to commit to, created from main if missing (default main)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files, their sizes, the total and the target, and upload nothing (needs no token)",
    )
    p.add_argument(
        "--commit-message",
        metavar="M",
        default="",
        help="the commit's message (default: 'Upload DIR with pretrain push')",
    )


# ---- what is uploaded ----------------------------------------------------------------------------------


def export_files(folder: Path) -> list[tuple[str, int]]:
    """(path in the repo, bytes) of every file upload_folder would send, sorted: huggingface_hub's own
    ignore rules (a .git folder, its upload cache under .cache/huggingface) applied the way it applies them."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    kept = filter_repo_objects(list(sizes), ignore_patterns=DEFAULT_IGNORE_PATTERNS)
    return sorted((path, sizes[path]) for path in kept)


def check_export(folder: Path) -> list[tuple[str, int]]:
    """The files of `folder` when it is a Hugging Face export: config.json (a JSON object) and its weights
    (model.safetensors, or model.safetensors.index.json and every shard it names); else one line."""
    make = f"make one with `pretrain export RUN_DIR --output {folder} --format hf`"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a directory: {make}")
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} is not a Hugging Face export (no config.json): {make}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}/config.json cannot be read as JSON ({e}): {make} again") from None
    if not isinstance(config, dict):
        raise UserError(f"{folder}/config.json is not a JSON object: {make} again")
    weights = {p.name for p in folder.glob("*.safetensors")}
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if "model.safetensors" not in weights:
            raise UserError(
                f"{folder} has no weights (model.safetensors or model.safetensors.index.json): {make}"
            )
        named = {"model.safetensors"}
    else:
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index} is not a safetensors index (no weight_map): {make} again") from None
        if missing := sorted(named - weights):
            raise UserError(
                f"{folder} lacks {len(missing)} weight shard(s) its index names, e.g. {missing[0]}: {make} again"
            )
    # Weights left by an earlier export (transformers loads model.safetensors before any index): the
    # repo would hold two models.
    if stray := sorted(weights - named):
        raise UserError(
            f"{folder} holds weights its export does not name ({', '.join(stray[:3])}): left by an earlier "
            f"export? Export into an empty folder: pretrain export RUN_DIR --output NEW_DIR --format hf"
        )
    return export_files(folder)


def check_repo(repo: str) -> None:
    """ORG/NAME as the Hub accepts it (huggingface_hub's copy of the Hub's rules), the ORG spelled out."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    org, slash, name = repo.partition("/")
    if not (org and slash and name):
        raise UserError(f"--repo {repo!r}: {REPO_RULE}, e.g. my-org/tiny-shakespeare")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UserError(f"--repo {repo!r}: {REPO_RULE}") from None


def human(n: int) -> str:
    """Bytes in the Hub's decimal units: 812 B, 4.1 kB, 498.3 MB."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def listing(files: list[tuple[str, int]]) -> list[str]:
    width = max(len(path) for path, _ in files)
    total = sum(size for _, size in files)
    lines = [f"  {path:<{width}}  {human(size):>9}" for path, size in files]
    lines.append(f"  {'total':<{width}}  {human(total):>9}  ({total} bytes)")
    return lines


# ---- the Hub ---------------------------------------------------------------------------------------------


def hub_client(token: str) -> Any:
    """The Hub client the push goes through (huggingface_hub's HfApi; HF_ENDPOINT picks another Hub). The
    only seam: the tests replace it by a recorder, since the real Hub is out of their reach."""
    from huggingface_hub import HfApi

    return HfApi(token=token)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a Hub request raises: the HTTP client's errors (refused, timed out, an HTTP status; huggingface_hub's
    own subclass them) and OSError (a file that cannot be read)."""
    import httpx2

    return httpx2.HTTPError, OSError


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "<token>") if token else text


def hub_error(e: BaseException, repo: str, revision: str, token: str) -> UserError:
    """One line that says what went wrong and what to do, the token cut out of anything the Hub echoed."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    server = (getattr(e, "server_message", "") or "").strip().splitlines()
    said = f": {server[0][:200]}" if server else ""
    if status == 401:
        line = f"the Hub refused the token (HTTP 401{said}); {LOGIN_HINT}"
    elif status == 403:
        line = (
            f"the token may not write to {repo} (HTTP 403{said}): use a token with write access to "
            f"{repo.split('/')[0]} (a fine-grained token needs write access to that repo or organization)"
        )
    elif status == 404:
        line = f"the Hub has no {repo} at revision {revision} (HTTP 404{said}); check --repo and --revision"
    elif status is not None:
        line = f"the Hub at {_endpoint()} answered HTTP {status}{said} for {repo}; try again later"
    elif isinstance(e, OSError) and e.strerror:
        line = f"cannot read {e.filename or 'a file of the export'}: {e.strerror}"
    else:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        line = f"cannot reach the Hub at {_endpoint()}: {why}; check the network or HF_ENDPOINT"
    return UserError(_scrub(line, token))


def push(api: Any, folder: Path, repo: str, revision: str, private: bool, message: str) -> Any:
    """Create the repo (and the branch), then upload the folder in one commit that also deletes the repo's
    weight files it does not carry; the commit's info."""
    api.create_repo(repo, repo_type="model", private=True if private else None, exist_ok=True)
    if revision != DEFAULT_REVISION and not revision.startswith("refs/"):
        api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
    return api.upload_folder(
        repo_id=repo,
        folder_path=str(folder),
        repo_type="model",
        revision=revision,
        commit_message=message,
        delete_patterns=WEIGHTS,
    )


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import get_token

    folder = Path(args.dir)
    files = check_export(folder)
    check_repo(args.repo)
    revision = args.revision.strip()
    if not revision:
        raise UserError("--revision must name a branch, e.g. main")
    target = f"{args.repo} (revision {revision}, {'private' if args.private else 'public unless the organization defaults to private'})"
    total = human(sum(size for _, size in files))
    if args.dry_run:
        print(f"push --dry-run: would upload {len(files)} files, {total}, from {folder} to {target}:")
        print("\n".join(listing(files)))
        print("nothing uploaded (--dry-run)", flush=True)
        return 0
    token = get_token()
    if not token:
        raise UserError(f"no Hugging Face token to push to {args.repo}: {LOGIN_HINT}")
    message = args.commit_message or f"Upload {folder.resolve().name} with pretrain push"
    print(
        f"push: {len(files)} files, {total}, from {folder} to {target}; huggingface_hub shows the upload's progress",
        flush=True,
    )
    try:
        info = push(hub_client(token), folder, args.repo, revision, args.private, message)
    except _network_errors() as e:
        raise hub_error(e, args.repo, revision, token) from None
    except Exception as e:
        # Not a failure a user can fix by input: a crash, with the token cut out of its message.
        raise RuntimeError(_scrub(f"push to {args.repo} failed: {type(e).__name__}: {e}", token)) from None
    url = getattr(info, "commit_url", "") or f"{_endpoint()}/{args.repo}/tree/{revision}"
    print(f"push: {args.repo} at {revision}: {url}", flush=True)
    return 0
