"""Publishing a dataset to the Hub: verified shards, ``manifest.json`` and a dataset card.

:func:`push` runs in three phases, and nothing is written anywhere before the
first two have passed:

1. **Remote checks** (read-only requests): a token is present and accepted
   (``whoami``), the dataset repository exists (or ``create=True``; a *model*
   repository of that name is refused by name), the branch exists; the files
   already at the target path and the current card are listed at the branch's
   commit, which is pinned as the new commit's parent.
2. **Local preparation**: the source becomes a list of shards (an `.atp`
   file, a directory of `.atp` or ``.pt`` shards as is, anything else converted
   into `.atp` shards in a temporary directory first); every shard is verified
   (:func:`pyg_atompack.convert.summary.verify_source`: both header slots, schema,
   index, every record; the manifest's sizes and sha256 when there is one); the
   manifest is written (or the existing one checked and completed with fields,
   units, source and converter); the card is generated or merged.
3. **Upload and commit** through huggingface_hub's own upload API
   (``HfApi.create_repo``, ``preupload_lfs_files`` per shard, one
   ``create_commit`` with ``parent_commit``): shards whose sha256 already equals
   the remote listing's are not sent at all, and objects uploaded by an
   interrupted earlier push are recognised by the Hub (LFS batch / Xet dedup)
   and not sent again, so re-running the same push resumes it.

The layout is :mod:`atompack.hub`'s: shards under ``path_in_repo`` with their
relative paths kept (POSIX path order is the global order) and ``manifest.json``
beside them. Shard files (``*.atp``, ``*.pt``) that an earlier push listed in
the path's ``manifest.json`` and that this one does not publish are deleted in
the same commit, otherwise readers would count them into the dataset; other
shard files under the path (not ours) make ``push`` refuse instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyg_atompack.hub.errors import (
    HubError,
    HubRepositoryNotFoundError,
    HubRevisionNotFoundError,
    HubTransferError,
    describe_remote,
)
from pyg_atompack.hub.remote import (
    is_commit_sha,
    list_remote_files,
    make_api,
    resolve_revision,
    translate_errors,
)
from pyg_atompack.hub.uri import normalize_path_in_repo
from pyg_atompack.remote.files import RemoteFile

MANIFEST_NAME = "manifest.json"
CARD_NAME = "README.md"
_SHARD_SUFFIXES = (".atp", ".pt")

#: ``progress(total_bytes)`` returns an object with ``update(n)`` and ``close()`` (a tqdm).
ProgressFactory = Callable[[int], Any]


class HubPublishError(HubError, ValueError):
    """``push`` / ``pull`` refused their input: nothing was uploaded (or downloaded).

    The message names the local file or the remote repository, and what to do.
    """


@dataclass(frozen=True)
class PushResult:
    """What :func:`push` published.

    Attributes:
        repo_id: The dataset repository.
        path_in_repo: Where the shards are (``""``: the root).
        branch: The branch that was pushed to.
        commit: The 40-hex commit that holds the dataset (the existing head when
            nothing had to change).
        uri: ``hf://datasets/{repo}@{commit}/{path}``, to pin in training configs.
        uploaded: Paths in the repository added or replaced by the commit.
        unchanged: Paths already on the Hub with the same content (not sent).
        deleted: Stale shard paths the commit removed.
        card: ``"written"`` (new card), ``"updated"`` (generated card updated),
            ``"kept"`` (hand-written card left alone), ``"replaced"``
            (hand-written card replaced with ``overwrite_card``) or ``"unchanged"``.
        manifest: The published manifest.
    """

    repo_id: str
    path_in_repo: str
    branch: str
    commit: str
    uri: str
    uploaded: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    card: str = "unchanged"
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class _Staged:
    root: Path
    shards: list[str]  # paths relative to root, POSIX, in global order
    shard_format: str
    manifest: dict[str, Any] | None
    source: dict[str, Any]


def _join(path_in_repo: str, name: str) -> str:
    return f"{path_in_repo}/{name}" if path_in_repo else name


def _fail(message: str) -> HubPublishError:
    return HubPublishError(message)


# ---------------------------------------------------------------------- phase 1: remote
def _require_token(token: str | bool | None, endpoint: str | None) -> str:
    from huggingface_hub import get_token

    if token is False:
        raise _fail("push needs a Hub token with write access, and token=False was given")
    resolved = token if isinstance(token, str) and token else get_token()
    if not resolved:
        raise _fail("no Hub token: log in with `hf auth login` or set HF_TOKEN to a token "
                    "with write access; nothing was uploaded")
    api = make_api(endpoint)
    try:
        api.whoami(token=resolved)
    except Exception as exc:
        # huggingface_hub 1.x+ raises HfHubHTTPError; 0.x re-raises a 401 as a plain
        # requests.HTTPError: both carry the response
        if getattr(getattr(exc, "response", None), "status_code", None) == 401:
            raise _fail(f"the Hub at {api.endpoint} rejected the token (401): log in again "
                        "with `hf auth login` or set HF_TOKEN; nothing was uploaded") from None
        with translate_errors("", None, None):
            raise
    return resolved


def _check_client_endpoint(endpoint: str | None) -> None:
    """Refuse, before anything is uploaded, an endpoint the installed client cannot commit to.

    huggingface_hub 0.x reads the URL of a new commit against ``HF_ENDPOINT``, not against
    the endpoint of the call (``CommitInfo`` takes no endpoint before 1.0): a commit to
    another endpoint is made, then ``create_commit`` raises ``ValueError``.
    """
    import huggingface_hub
    from huggingface_hub import constants

    if not endpoint or not huggingface_hub.__version__.startswith("0."):
        return
    if endpoint.rstrip("/") != constants.ENDPOINT.rstrip("/"):
        raise _fail(f"huggingface_hub {huggingface_hub.__version__} cannot commit to "
                    f"{endpoint} while HF_ENDPOINT is {constants.ENDPOINT} (before 1.0 it "
                    "reads the commit's URL against HF_ENDPOINT): set HF_ENDPOINT to "
                    f"{endpoint} before starting Python, or upgrade huggingface_hub; nothing "
                    "was uploaded")


def _remote_head(repo_id: str, branch: str, *, create: bool, token: str,
                 endpoint: str | None) -> str | None:
    """The branch head's commit, or ``None`` for a repository that ``push`` will create."""
    try:
        return resolve_revision(repo_id, branch, token=token, endpoint=endpoint)
    except HubRevisionNotFoundError:
        raise _fail(f"{describe_remote(repo_id, branch, None)}: branch not found; push writes "
                    "to an existing branch (create it with HfApi.create_branch, or push to "
                    "'main'); nothing was uploaded") from None
    except HubRepositoryNotFoundError:
        pass
    if create:
        if branch != "main":
            raise _fail(f"dataset repository {repo_id!r} does not exist yet: a new repository "
                        f"has only the branch 'main', not {branch!r}; nothing was uploaded")
        return None
    try:
        resolve_revision(repo_id, None, repo_type="model", token=token, endpoint=endpoint)
    except HubError:
        raise _fail(f"dataset repository {repo_id!r} not found (or not writable with this "
                    "token): pass create=True / --create to create it; nothing was "
                    "uploaded") from None
    raise _fail(f"{repo_id!r} exists as a model repository, not a dataset: push publishes "
                f"dataset repositories (hf://datasets/{repo_id}); choose another name or "
                "create the dataset with create=True / --create; nothing was uploaded")


def _remote_state(repo_id: str, path_in_repo: str, head: str | None, *, token: str,
                  endpoint: str | None) -> tuple[dict[str, RemoteFile], bytes | None, set[str]]:
    """Files under the path (and the card) at ``head``, the card's bytes, and the shard
    paths the path's remote manifest lists (what an earlier push published)."""
    from pyg_atompack.hub.errors import HubPathNotFoundError
    from pyg_atompack.hub.transfer import fetch_bytes

    remote: dict[str, RemoteFile] = {}
    if head is None:
        return remote, None, set()
    for root in [path_in_repo] + ([CARD_NAME] if path_in_repo else []):
        try:
            listed = list_remote_files(repo_id, root, revision=head, token=token,
                                       endpoint=endpoint, allow_empty=True)
        except HubPathNotFoundError:
            listed = []
        remote.update({f.name: f for f in listed if root == path_in_repo or f.name == CARD_NAME})
    remote_card = fetch_bytes(remote[CARD_NAME], token=token) if CARD_NAME in remote else None
    published: set[str] = set()
    manifest = remote.get(_join(path_in_repo, MANIFEST_NAME))
    if manifest is not None:
        published = _published_shards(fetch_bytes(manifest, token=token), path_in_repo)
    return remote, remote_card, published


def _published_shards(manifest_bytes: bytes, path_in_repo: str) -> set[str]:
    """Shard paths a remote ``pyg_atompack-shards/1`` manifest lists (empty if foreign)."""
    from pyg_atompack.convert.shards import MANIFEST_FORMAT

    try:
        manifest = json.loads(manifest_bytes)
        if manifest.get("format") != MANIFEST_FORMAT:
            return set()
        return {_join(path_in_repo, str(s["name"])) for s in manifest["shards"]}
    except (ValueError, TypeError, KeyError, AttributeError):
        return set()  # unreadable: nothing counts as published by us


# ---------------------------------------------------------------------- phase 2: local
def _stage(source: Path, work: Path, *, shard_size: int | None, compression: str | None,
           level: int, read_options: Any, src_format: str | None, progress: Any) -> _Staged:
    """The shards to publish: the source's own, or its conversion into `.atp` shards."""
    from pyg_atompack.convert import read_manifest

    if not source.exists():
        raise _fail(f"{source}: no such file or directory")
    as_is = shard_size is None and compression is None  # else: re-shard through the converter
    if as_is and source.is_file() and source.suffix == ".atp" and src_format in (None, "atp"):
        return _Staged(source.parent, [source.name], "atp", None,
                       {"name": source.name, "format": "atp"})
    if as_is and source.is_dir() and src_format in (None, "atp", "pt"):
        manifest = read_manifest(source)
        if manifest is not None:
            names = [str(s["name"]) for s in manifest["shards"]]
            if names != sorted(names):
                raise _fail(f"{source / MANIFEST_NAME}: shards are not listed in POSIX path "
                            "order, which readers of the Hub layout use as the global order")
            kinds = {Path(n).suffix for n in names}
            if not names or len(kinds) != 1 or not kinds <= set(_SHARD_SUFFIXES):
                raise _fail(f"{source / MANIFEST_NAME}: expected only .atp or only .pt shards, "
                            f"found {sorted(kinds) or 'none'}")
            return _Staged(source, names, kinds.pop()[1:], manifest,
                           dict(manifest.get("source") or {"name": source.name}))
        for suffix in _SHARD_SUFFIXES:
            found = sorted(p.relative_to(source).as_posix()
                           for p in source.rglob(f"*{suffix}") if p.is_file())
            if found:
                other = "pt" if suffix == ".atp" else "atp"
                if any(source.rglob(f"*.{other}")):
                    raise _fail(f"{source}: holds both .atp and .pt shards; publish one kind")
                return _Staged(source, found, suffix[1:], None,
                               {"name": source.name, "format": suffix[1:]})
    # anything else the converters read: convert into .atp shards first
    from pyg_atompack.convert import WriteOptions, convert, detect_source_format
    from pyg_atompack.convert.shards import DEFAULT_SHARD_SIZE

    fmt = src_format or detect_source_format(source)
    out = work / "shards"
    try:
        options = WriteOptions(compression=compression or "zstd", level=level,
                               shard_size=DEFAULT_SHARD_SIZE if shard_size is None else shard_size)
    except ValueError as exc:
        raise _fail(f"{source}: {exc}; nothing was uploaded") from exc
    convert(source, out, src_format=fmt, dst_format="atp-shards", read_options=read_options,
            write_options=options, progress=progress)
    manifest = read_manifest(out)
    info: dict[str, Any] = {"name": source.name, "format": fmt}
    units = getattr(read_options, "units", None)
    if units is not None:
        energy, length = getattr(units, "energy_unit", "eV"), getattr(units, "length_unit",
                                                                      "Angstrom")
        if (energy, length) != ("eV", "Angstrom"):
            info["units_converted_from"] = f"{energy} and {length}"
    return _Staged(out, [s["name"] for s in manifest["shards"]], "atp", manifest, info)


def _verify(staged: _Staged, source: Path) -> list[int]:
    """Verify every shard (and the manifest); the record count of each shard."""
    from pyg_atompack.convert.shards import check_manifest
    from pyg_atompack.convert.summary import verify_source

    if staged.manifest is not None:
        problems = check_manifest(staged.root)
        if problems:
            raise _fail(f"{source}: manifest check failed: {problems[0]}"
                        f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                        "nothing was uploaded")
    records = []
    for name in staged.shards:
        count, problems = verify_source(staged.root / name)
        if problems:
            raise _fail(f"{source}: shard {name} failed verification: {problems[0]}; "
                        "nothing was uploaded")
        records.append(count)
    return records


def _build_manifest(staged: _Staged, records: list[int], digests: dict[str, str]) -> dict:
    from pyg_atompack import __version__
    from pyg_atompack.convert.facts import describe_shards, units_of
    from pyg_atompack.convert.shards import MANIFEST_FORMAT

    facts = describe_shards([staged.root / n for n in staged.shards], staged.shard_format)
    informative = dict(staged.manifest or {})
    for key in ("format", "shards", "total_records", "created_at_utc"):
        informative.pop(key, None)  # created_at would make every re-push a new manifest
    shards = [{"name": name, "records": count, "bytes": (staged.root / name).stat().st_size,
               "sha256": digests[name]} for name, count in zip(staged.shards, records)]
    manifest = {
        "format": MANIFEST_FORMAT,
        "shards": shards,
        "total_records": sum(records),
        **informative,
        "shard_format": staged.shard_format,
        "total_atoms": facts["atoms"],
        "elements": facts["elements"],
        "fields": facts["fields"],
        "units": units_of(facts["fields"]),
        "source": staged.source,
        "converter": {"name": "pyg_atompack", "version": __version__},
    }
    return manifest


def _card(manifest: dict, remote_card: bytes | None, *, repo_id: str, path_in_repo: str,
          branch: str, license: str | None, extra: str | None,
          overwrite_card: bool) -> tuple[bytes | None, str]:
    from pyg_atompack.hub import card

    existing = None if remote_card is None else remote_card.decode("utf-8", errors="replace")
    if existing is not None and not card.is_generated(existing) and not overwrite_card:
        return None, "kept"
    section = card.render_section(manifest, repo_id=repo_id, path_in_repo=path_in_repo,
                                  revision=branch, extra=extra)
    generated = existing is not None and card.is_generated(existing)
    text = card.render_card(section, path_in_repo=path_in_repo, repo_id=repo_id,
                            license=license, existing=existing if generated else None)
    state = "written" if existing is None else ("updated" if generated else "replaced")
    return text.encode("utf-8"), state


def _plan(operations: dict[str, Any], digests: dict[str, str], remote: dict[str, RemoteFile],
          published: set[str], *, extra_files: dict[str, bytes | None],
          where: str) -> tuple[list[Any], list[str], list[str]]:
    """What the commit adds (differs from the remote listing), leaves alone, and deletes."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.utils.sha import git_hash

    adds, unchanged = [], []
    for name, op in operations.items():
        known = remote.get(op.path_in_repo)
        if known is not None and known.sha256 == digests[name]:
            unchanged.append(op.path_in_repo)
        else:
            adds.append(op)
    for path, data in extra_files.items():
        if data is None:
            continue
        known = remote.get(path)
        if known is not None and known.blob_id == git_hash(data):
            unchanged.append(path)
        else:
            adds.append(CommitOperationAdd(path, data))
    wanted = {op.path_in_repo for op in operations.values()}
    stale = sorted(p for p in remote if p.endswith(_SHARD_SUFFIXES) and p not in wanted)
    foreign = [p for p in stale if p not in published]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise _fail(f"{where}: holds shard files that this push does not publish and no "
                    f"manifest.json lists ({shown}); readers would count them into the "
                    "dataset: delete them or push to another path; nothing was uploaded")
    return adds, unchanged, stale


def _upload_and_commit(repo_id: str, path_in_repo: str, branch: str, head: str | None,
                       adds: list[Any], deletes: list[Any], *, summary: str, description: str,
                       private: bool | None, token: str, endpoint: str | None,
                       progress: ProgressFactory | None) -> str:
    """Create the repository if needed, upload the shards one by one, commit; the commit id."""
    api = make_api(endpoint)
    where = describe_remote(repo_id, branch, path_in_repo or None)
    if head is None:
        with translate_errors(repo_id, None, None):
            api.create_repo(repo_id, repo_type="dataset", private=private, token=token)
        head = resolve_revision(repo_id, branch, token=token, endpoint=endpoint)
    shard_adds = [op for op in adds if op.path_in_repo.endswith(_SHARD_SUFFIXES)]
    bar = progress(sum(op.upload_info.size for op in shard_adds)) if progress else None
    try:
        for op in shard_adds:  # one at a time: an interruption leaves whole shards behind
            try:
                api.preupload_lfs_files(repo_id, [op], repo_type="dataset", revision=branch,
                                        token=token, num_threads=1)
            except Exception as exc:  # the client wraps transfer errors in RuntimeError
                cause = exc.__cause__ or exc
                raise HubTransferError(
                    f"{where}: upload of {op.path_in_repo} failed ({type(cause).__name__}: "
                    f"{cause}); nothing was committed: run the same push again to resume "
                    "(shards already uploaded are not sent again)") from exc
            if bar is not None:
                bar.update(op.upload_info.size)
    finally:
        if bar is not None:
            bar.close()
    with translate_errors(repo_id, branch, path_in_repo or None):
        try:
            info = api.create_commit(repo_id, adds + deletes, commit_message=summary,
                                     commit_description=description, repo_type="dataset",
                                     revision=branch, parent_commit=head, token=token)
        except Exception as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status == 412:
                raise HubTransferError(f"{where}: the branch moved while pushing (someone "
                                       "else committed); run the push again") from exc
            raise
    return info.oid


# ---------------------------------------------------------------------- the entry point
def push(
    source: str | os.PathLike,
    repo_id: str,
    *,
    path_in_repo: str = "",
    revision: str = "main",
    private: bool | None = None,
    create: bool = False,
    message: str | None = None,
    card_extra: str | os.PathLike | None = None,
    overwrite_card: bool = False,
    license: str | None = None,
    shard_size: int | None = None,
    compression: str | None = None,
    level: int = 3,
    read_options: Any = None,
    src_format: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    work_dir: str | os.PathLike | None = None,
    progress: ProgressFactory | None = None,
    convert_progress: Callable[[int | None], Any] | None = None,
) -> PushResult:
    """Publish a dataset as verified `.atp` (or ``.pt``) shards, a manifest and a card.

    Args:
        source (str | os.PathLike): An `.atp` file, a directory of `.atp` or ``.pt`` shards, or
            anything :func:`pyg_atompack.convert.convert` reads (converted to `.atp` shards first).
        repo_id (str): The dataset repository, ``owner/name``.
        path_in_repo (str, optional): Directory for the shards (``""``: the root).
            (default: :obj:`""`)
        revision (str, optional): The branch to commit to. (default: :obj:`"main"`)
        private (bool, optional): Visibility of a repository created here. (default: :obj:`None`)
        create (bool, optional): Create the dataset repository when it does not exist.
            (default: :obj:`False`)
        message (str, optional): Commit message. (default: a summary of what is published)
        card_extra (str | os.PathLike, optional): A text file (source, citation, license notes)
            added to the card. (default: :obj:`None`)
        overwrite_card (bool, optional): Replace a ``README.md`` written by hand.
            (default: :obj:`False`)
        license (str, optional): License id for the card's front matter.
            (default: keep, or ``"other"``)
        shard_size (int, optional): Structures per shard. `.atp` and ``.pt`` sources are published
            as they are unless ``shard_size`` or ``compression`` is given, which
            re-shards them; other sources are always converted. (default: ``1000``
            when converting)
        compression (str, optional): Codec of converted shards.
            (default: ``"zstd"`` when converting)
        level (int, optional): zstd level of converted shards. (default: :obj:`3`)
        read_options (Any, optional): :class:`pyg_atompack.convert.ReadOptions` for converting.
            (default: :obj:`None`)
        src_format (str, optional): Source format name when the path does not tell.
            (default: :obj:`None`)
        token (str | bool, optional): Hub token (``None``: the saved login / ``HF_TOKEN``).
            (default: :obj:`None`)
        endpoint (str, optional): Hub base URL (``None``: huggingface_hub's configured endpoint).
            (default: :obj:`None`)
        work_dir (str | os.PathLike, optional): Where converted shards are written
            (default: a temporary directory).
        progress (ProgressFactory, optional): Factory of a byte progress bar for the upload, called
            with the total. (default: :obj:`None`)
        convert_progress (Callable[[int | None], Any], optional): Factory of a structure progress
            bar for the conversion. (default: :obj:`None`)

    Returns:
        A :class:`PushResult` with the commit and the pinned ``hf://`` URI.

    Raises:
        HubPublishError: Bad input (a shard failing verification, no token, a model
            repository, an unknown branch, with huggingface_hub 0.x an ``endpoint`` other
            than ``HF_ENDPOINT``, ...): raised before anything is uploaded.
        HubTransferError: The upload was interrupted; nothing was committed, and
            running the same push again resumes it.
        pyg_atompack.convert.ConvertError: The source cannot be converted.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise _fail(f"repository id must be owner/name, got {repo_id!r}")
    path_in_repo = normalize_path_in_repo(path_in_repo)
    if not revision or is_commit_sha(revision):
        raise _fail(f"push needs a branch name as revision, got {revision!r}")
    source = Path(source).expanduser()
    extra = None
    if card_extra is not None:
        try:
            extra = Path(card_extra).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise _fail(f"{card_extra}: cannot read the card text: {exc}") from exc

    # phase 1: remote, read-only
    _check_client_endpoint(endpoint)
    token = _require_token(token, endpoint)
    head = _remote_head(repo_id, revision, create=create, token=token, endpoint=endpoint)
    remote, remote_card, published = _remote_state(repo_id, path_in_repo, head, token=token,
                                                   endpoint=endpoint)

    # phase 2: local
    with tempfile.TemporaryDirectory(prefix="pyg_atompack-push-",
                                     dir=work_dir) as work:
        staged = _stage(source, Path(work), shard_size=shard_size, compression=compression,
                        level=level, read_options=read_options, src_format=src_format,
                        progress=convert_progress)
        records = _verify(staged, source)
        operations = {name: CommitOperationAdd(_join(path_in_repo, name),
                                               str(staged.root / name))
                      for name in staged.shards}
        digests = {name: op.upload_info.sha256.hex() for name, op in operations.items()}
        manifest = _build_manifest(staged, records, digests)
        manifest_bytes = (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode()
        card_bytes, card_state = _card(manifest, remote_card, repo_id=repo_id,
                                       path_in_repo=path_in_repo, branch=revision,
                                       license=license, extra=extra,
                                       overwrite_card=overwrite_card)

        adds, unchanged, stale = _plan(operations, digests, remote, published,
                                       extra_files={_join(path_in_repo, MANIFEST_NAME):
                                                    manifest_bytes, CARD_NAME: card_bytes},
                                       where=describe_remote(repo_id, revision,
                                                             path_in_repo or "/"))
        if card_state != "kept" and CARD_NAME in unchanged:
            card_state = "unchanged"
        deletes = [CommitOperationDelete(p) for p in stale]

        def result(commit: str, uploaded: list[str]) -> PushResult:
            uri = f"hf://datasets/{repo_id}@{commit}" + (f"/{path_in_repo}" * bool(path_in_repo))
            return PushResult(repo_id, path_in_repo, revision, commit, uri,
                              tuple(uploaded), tuple(unchanged), tuple(stale), card_state,
                              manifest)

        if not adds and not deletes:
            return result(head, [])

        # phase 3: upload and commit
        total = manifest["total_records"]
        summary = message or (f"Publish {len(staged.shards)} {staged.shard_format} shards "
                              f"({total} structures) at /{path_in_repo} with pyg_atompack")
        description = "\n".join(
            [f"Uploaded: {', '.join(op.path_in_repo for op in adds)}"]
            + ([f"Unchanged: {', '.join(unchanged)}"] if unchanged else [])
            + ([f"Deleted stale shards: {', '.join(stale)}"] if stale else []))
        commit = _upload_and_commit(repo_id, path_in_repo, revision, head, adds, deletes,
                                    summary=summary, description=description, private=private,
                                    token=token, endpoint=endpoint, progress=progress)
        return result(commit, [op.path_in_repo for op in adds])
