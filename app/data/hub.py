"""HF Hub access through huggingface_hub: list a dataset's files, download them (cached, resumable),
and fetch a tokenizer.json from a model repo.

The token comes only from the HF_TOKEN environment variable (never a token file, never logged). The
listing is pinned to one commit, so a re-run reads the same bytes; huggingface_hub keeps finished
downloads in its cache (HF_HUB_CACHE or --cache-dir), so a re-run after a crash fetches only files it
had not finished (huggingface_hub 2.x retries a broken transfer with a Range request within the process,
but restarts a file whose process died).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from app.data.sources import SourceFile, file_format, list_local
from app.errors import UserError

DATASET_PREFIX = "hf://datasets/"
USAGE = "hf://datasets/OWNER/NAME[@REVISION][/GLOB][?include=GLOB]"


def _token() -> str | bool:
    """HF_TOKEN from the environment, else False (huggingface_hub must not read a token file)."""
    return os.environ.get("HF_TOKEN") or False


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def parse_dataset_url(url: str, revision: str | None = None, includes: Iterable[str] = ()) -> tuple:
    """hf://datasets/OWNER/NAME[@REV][/GLOB][?include=GLOB&include=GLOB&revision=REV] -> (repo, include
    globs: fnmatch patterns over repo paths, empty for every supported file, revision)."""
    if not url.startswith(DATASET_PREFIX):
        raise UserError(f"hub inputs look like {USAGE}, got {url}")
    segs = url[len(DATASET_PREFIX) :].split("?", 1)[0].strip("/").split("/")
    if len(segs) < 2 or not segs[0] or not segs[1]:
        raise UserError(f"hub input {url} needs OWNER/NAME: {USAGE}")
    name, _, rev_at = segs[1].partition("@")
    query = parse_qs(urlsplit(url).query)
    unknown = set(query) - {"include", "revision"}
    if unknown:
        raise UserError(
            f"hub input {url}: unknown parameter {sorted(unknown)[0]!r}; use include= or revision="
        )
    globs = [g for v in query.get("include", []) for g in v.split(",") if g]
    if len(segs) > 2:
        globs.append("/".join(segs[2:]))
    rev = (query.get("revision") or [None])[0] or rev_at or revision
    return f"{segs[0]}/{name}", [*globs, *includes], rev


def _hub_error(e: Exception, what: str, revision: str | None = None) -> UserError:
    """One line saying what to do, for the errors huggingface_hub and its HTTP client raise."""
    from huggingface_hub import errors

    status = getattr(getattr(e, "response", None), "status_code", None)
    token_state = "HF_TOKEN is set" if _token() else "HF_TOKEN is not set"
    if isinstance(e, errors.GatedRepoError):
        return UserError(
            f"{what} is gated: accept its terms on the Hub with your account and set HF_TOKEN to that account's "
            f"token ({token_state})"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return UserError(f"{what} has no revision {revision!r}")
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return UserError(f"{what} not found on the Hub")
    if isinstance(e, errors.RepositoryNotFoundError) or status in (401, 403):
        return UserError(
            f"{what} does not exist or refuses access (HTTP {status}): check the name; if it is private or gated, "
            f"set HF_TOKEN to a token with read access ({token_state})"
        )
    if isinstance(e, errors.HfHubHTTPError):
        return UserError(f"the Hub at {endpoint()} answered HTTP {status} for {what}; try again later")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return UserError(f"cannot fetch {what}: HF_HUB_OFFLINE is set")
    if isinstance(e, OSError) and not isinstance(e, errors.LocalEntryNotFoundError) and e.strerror:
        return UserError(
            f"cannot store {what} in the download cache: {e.strerror} ({e.filename or 'HF_HUB_CACHE'})"
        )
    return UserError(
        f"cannot reach the Hub at {endpoint()} for {what}: {type(e).__name__}; check the network or HF_ENDPOINT"
    )


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a Hub request raises: huggingface_hub's own errors subclass OSError (HfHubHTTPError both)."""
    import httpx2

    return httpx2.HTTPError, OSError


def list_dataset_files(
    url: str, revision: str | None = None, includes: Iterable[str] = ()
) -> list[SourceFile]:
    """The supported files of a dataset repo matching the include patterns, sorted, pinned to one commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    repo, globs, rev = parse_dataset_url(url, revision, includes)
    what = f"hub dataset {repo}"
    api = HfApi(token=_token())
    try:
        sha = api.dataset_info(repo, revision=rev).sha
        entries = {
            f.path: f
            for f in api.list_repo_tree(repo, repo_type="dataset", revision=sha, recursive=True)
            if isinstance(f, RepoFile)
        }
    except _network_errors() as e:
        raise _hub_error(e, what, rev) from None
    if not sha:
        raise UserError(f"the Hub at {endpoint()} gave no commit for {what}")
    matched = sorted(filter_repo_objects(list(entries), allow_patterns=globs or None))
    usable = [p for p in matched if file_format(p)]
    if not usable:
        pattern = f" matching {', '.join(globs)}" if globs else ""
        sample = ", ".join(sorted(entries)[:5]) or "(none)"
        raise UserError(
            f"{what} has no parquet/jsonl/txt files{pattern} ({len(entries)} files, e.g. {sample}); "
            "fix the include pattern"
        )
    files = []
    for p in usable:
        e = entries[p]
        fmt, comp = file_format(p)  # type: ignore[misc]
        fingerprint = e.lfs.sha256 if e.lfs is not None else e.blob_id
        files.append(SourceFile(p, int(e.size), f"{e.size}:{fingerprint}", fmt, comp, repo=repo, commit=sha))
    return files


def _download(what: str, revision: str | None, cache_dir: str | None, **file) -> Path:
    """Local path of a hub file: from the download cache, else downloaded into it."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(**file, revision=revision, cache_dir=cache_dir, token=_token()))
    except _network_errors() as e:
        raise _hub_error(e, what, revision) from None


def download(f: SourceFile, cache_dir: str | None = None) -> Path:
    return _download(f.label, f.commit, cache_dir, repo_id=f.repo, filename=f.name, repo_type="dataset")


def download_tokenizer(spec: str, cache_dir: str | None = None) -> tuple[str, Path]:
    """hf://OWNER/NAME[@REV] (a model repo) -> (repo label, path of its tokenizer.json)."""
    repo, _, rev = spec[len("hf://") :].strip("/").partition("@")
    if repo.startswith(("datasets/", "spaces/")) or repo.count("/") > 1 or not repo:
        raise UserError(f"--tokenizer {spec}: expected hf://OWNER/NAME[@REVISION] of a model repo")
    path = _download(
        f"tokenizer.json of hub repo {repo}", rev or None, cache_dir, repo_id=repo, filename="tokenizer.json"
    )
    return f"hf://{repo}" + (f"@{rev}" if rev else ""), path


def resolve_inputs(
    specs: list[str], revision: str | None = None, includes: Iterable[str] = ()
) -> list[SourceFile]:
    """All input files in a fixed order: inputs in the order given, files sorted within each."""
    files: list[SourceFile] = []
    for spec in specs:
        if spec.startswith("hf://"):
            files.extend(list_dataset_files(spec, revision=revision, includes=includes))
        else:
            files.extend(list_local(spec))
    return files
