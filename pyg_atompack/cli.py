"""The ``pyg-atompack`` command line: convert, merge, info, verify, shard, head, push, pull.

Exit codes: 0 success, 1 ``verify`` found problems, 2 bad input (a one-line
error naming the file and the problem; no partial output is left behind).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2


class _Fail(Exception):
    """A user-facing failure with its exit code."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


def _progress_factory(quiet: bool, unit: str = "structure", **options: Any):
    """tqdm bars on stderr, off when ``--quiet`` or stderr is not a terminal.

    Args:
        quiet (bool): ``--quiet`` was given.
        unit (str, optional): What the bar counts. (default: :obj:`"structure"`)
        **options (optional): More ``tqdm`` arguments (``unit_scale``, ``desc``).
    """
    disabled = quiet or not sys.stderr.isatty()

    def factory(total: int | None) -> Any:
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, disable=disabled, file=sys.stderr,
                    dynamic_ncols=True, **options)

    return factory


def _add_key_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("keys and units of the source")
    group.add_argument("--energy-key", metavar="K",
                       help="source key (info/calculator key, file stem, target) of the energy")
    group.add_argument("--forces-key", metavar="K", help="source key of the forces")
    group.add_argument("--stress-key", metavar="K",
                       help="source key of the stress (Voigt-6 or 3x3)")
    group.add_argument("--key-map", metavar="SRC=DST", action="append", default=[],
                       help="rename a source key; DST may be a builtin (charges, velocities, "
                            "...); repeat or comma-separate")
    group.add_argument("--virial-key", metavar="K",
                       help="source key of the virial (Voigt-6 or 3x3, energy units), stored "
                            "as stress = -virial / volume (ASE sign); periodic structures only")
    group.add_argument("--skip-target", metavar="NAME", action="append", default=[],
                       help="a DiskDataset target or memmap file stem not to read (e.g. a "
                            "multi-block spherical target); elsewhere like --drop-key; repeat")
    group.add_argument("--energy-unit", default="eV",
                       help="energy unit of the source: eV, meV, kcal/mol, kJ/mol, Hartree, Ry "
                            "(converted to eV; default: eV)")
    group.add_argument("--length-unit", default="Angstrom",
                       help="length unit of the source: Angstrom, Bohr, nm (default: Angstrom)")
    group.add_argument("--from", dest="src_format", metavar="FORMAT",
                       help="source format when the path does not tell")


def _add_type_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("types of custom keys (one type per key in the output)")
    group.add_argument("--drop-key", metavar="KEY", action="append", default=[],
                       help="leave a custom key out of the output; repeat")
    group.add_argument("--cast", metavar="KEY=DTYPE", action="append", default=[],
                       help="store a custom key as float64, float32, int64 or int32; repeat or "
                            "comma-separate (keys that widen, e.g. int then float, are "
                            "promoted without it)")


def _read_options(args: argparse.Namespace):
    from pyg_atompack.convert import ReadOptions, UnitConversion, parse_casts, parse_key_map

    try:
        return ReadOptions(
            energy_key=args.energy_key, forces_key=args.forces_key,
            stress_key=args.stress_key, key_map=parse_key_map(args.key_map),
            units=UnitConversion(args.energy_unit, args.length_unit),
            virial_key=args.virial_key, skip_targets=tuple(args.skip_target),
            drop_keys=tuple(getattr(args, "drop_key", ())),
            casts=parse_casts(getattr(args, "cast", None)),
        )
    except ValueError as exc:
        raise _Fail(str(exc)) from exc


def _cmd_convert(args: argparse.Namespace) -> int:
    from pyg_atompack.convert import WriteOptions, convert

    try:
        options = WriteOptions(compression=args.compression, level=args.level,
                               shard_size=args.shard_size, overwrite=args.overwrite)
    except ValueError as exc:
        raise _Fail(str(exc)) from exc
    count = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.to,
                    read_options=_read_options(args), write_options=options,
                    progress=_progress_factory(args.quiet), workers=args.workers,
                    part=_part(args.part))
    if not args.quiet:
        print(f"wrote {count} structures to {args.dst}")
    return EXIT_OK


def _part(text: str | None):
    from pyg_atompack.convert.parallel import Part

    if text is None:
        return None
    try:
        return Part.parse(text)
    except ValueError as exc:
        raise _Fail(str(exc)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_merge(args: argparse.Namespace) -> int:
    from pyg_atompack.convert.merge import merge_parts

    count = merge_parts(args.out, args.parts, overwrite=args.overwrite)
    if not args.quiet:
        print(f"merged {len(args.parts)} parts, {count} structures, into {args.out}")
    return EXIT_OK


def _cmd_shard(args: argparse.Namespace) -> int:
    from pyg_atompack.convert import shard

    count = shard(args.src, args.out_dir, args.shard_size, overwrite=args.overwrite,
                  progress=_progress_factory(args.quiet))
    if not args.quiet:
        print(f"wrote {count} structures as .pt shards to {args.out_dir}")
    return EXIT_OK


def _is_url(path: str) -> bool:
    from pyg_atompack.remote.backends import url_scheme

    return url_scheme(path) is not None


def _open_remote(url: str) -> Any:
    """The lazy reader of a remote ``.atp`` source (nothing downloaded yet)."""
    from pyg_atompack import hub

    return hub.open_remote_atp(url)


def _print_head(structures: Iterable[Any], n: int) -> int:
    """Print one line for each of the first ``n`` structures (``head``)."""
    from pyg_atompack.convert.summary import summarize_structure

    for index, structure in enumerate(itertools.islice(structures, max(n, 0))):
        print(summarize_structure(index, structure))
    return EXIT_OK


def _remote_structures(remote: Any, args: argparse.Namespace) -> Iterator[Any]:
    """The structures of a remote source in order; a shard is fetched when first read."""
    from pyg_atompack.convert import open_reader

    for shard in range(len(remote.shards)):
        local = remote.shard_reader(shard).path
        with open_reader(local, "atp", _read_options(args)) as reader:
            yield from reader


def _remote_info(args: argparse.Namespace) -> int:
    """Counts and fields of a remote source from header, index and schema range reads."""
    remote = _open_remote(args.path)
    lines = [f"path: {args.path}", "format: atp (remote)",
             f"size: {sum(s.size for s in remote.shards)} bytes",
             f"shards: {len(remote.shards)}"]
    lines += [f"  {shard.name}: {count} records, {shard.size} bytes"
              for shard, count in zip(remote.shards, remote.shard_lengths.tolist())]
    lines += [f"structures: {len(remote)}", f"atoms: {int(remote.n_atoms.sum())}", "fields:"]
    for name, info in remote.fields.items():
        dtype = "str" if info.dtype is None else str(info.dtype)
        shape = "" if not info.shape else "[" + ",".join(map(str, info.shape)) + "]"
        where = "per atom" if info.per_atom else "per structure"
        lines.append(f"  {name}: {dtype}{shape} ({where})")
    print("\n".join(lines))
    return EXIT_OK


def _remote_verify(args: argparse.Namespace) -> int:
    """Download every shard (verified against the listing), then check each one fully."""
    from pyg_atompack.convert.summary import verify_source
    from pyg_atompack.transport import RemoteIntegrityError

    remote = _open_remote(args.path)
    count, problems = 0, []
    for shard in range(len(remote.shards)):
        name = remote.shards[shard].name
        try:
            local = remote.shard_reader(shard).path
        except RemoteIntegrityError as error:
            problems.append(str(error))
            continue
        shard_count, shard_problems = verify_source(local, src_format="atp")
        count += shard_count
        problems += [f"{name}: {problem}" for problem in shard_problems]
    return _verify_report(args.path, count, problems)


def _verify_report(path: str, count: int, problems: list[str]) -> int:
    if problems:
        for problem in problems:
            print(f"FAIL {problem}")
        print(f"{path}: {len(problems)} problem(s)")
        return EXIT_PROBLEMS
    print(f"OK {path}: {count} structures decoded, all checks passed")
    return EXIT_OK


def _cmd_head(args: argparse.Namespace) -> int:
    from pyg_atompack.convert import open_reader

    if _is_url(args.path):
        # closing() ends the shard reader left open when the first n are printed
        remote = _open_remote(args.path)
        with contextlib.closing(_remote_structures(remote, args)) as structures:
            return _print_head(structures, args.n)
    with open_reader(args.path, args.src_format, _read_options(args)) as reader:
        return _print_head(reader, args.n)


def _cmd_info(args: argparse.Namespace) -> int:
    from pyg_atompack.convert import detect_source_format, read_manifest
    from pyg_atompack.convert.summary import directory_size, scan

    if _is_url(args.path):
        return _remote_info(args)
    path = Path(args.path)
    fmt = detect_source_format(path)
    lines = [f"path: {path}", f"format: {fmt}", f"size: {directory_size(path)} bytes"]
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest is not None:
        lines.append(f"shards: {len(manifest['shards'])} (manifest.json, "
                     f"{manifest.get('total_records')} records)")
        lines += [f"  {s['name']}: {s['records']} records, {s['bytes']} bytes"
                  for s in manifest["shards"]]
    if fmt == "atp":
        lines += _atp_info_lines(path, list_shards=manifest is None)
    else:
        summary = scan(path, progress=_progress_factory(args.quiet), format=fmt)
        lines += [f"structures: {summary['structures']}", f"atoms: {summary['atoms']}",
                  "fields:"]
        lines += [f"  {name}: {kind} (in {count})"
                  for name, (kind, count) in summary["fields"].items()]
    print("\n".join(lines))
    return EXIT_OK


def _atp_info_lines(path: Path, list_shards: bool) -> list[str]:
    """Header facts, counts and schema fields of an `.atp` file or shard directory."""
    from pyg_atompack import atp
    from pyg_atompack.convert.summary import describe_atp_fields

    files = [path] if path.is_file() else sorted(path.rglob("*.atp"), key=lambda p: p.as_posix())
    described = [atp.describe(file) for file in files]
    first = described[0]
    lines = [f"codec: {first['codec']} (level {first['level']})",
             f"record format: {first['record_format']}",
             f"positions dtype: {first['positions_dtype']}"]
    if list_shards and path.is_dir():
        lines.append(f"shards: {len(files)}")
        lines += [f"  {f.relative_to(path).as_posix()}: {d['num_molecules']} records, "
                  f"{d['file_size']} bytes" for f, d in zip(files, described)]
    lines += [f"structures: {sum(d['num_molecules'] for d in described)}",
              f"atoms: {sum(d['total_atoms'] for d in described)}", "fields:"]
    fields = describe_atp_fields(files)
    lines += [f"  {name}: {kind}" for name, kind in fields.items()]
    if any(f["kind"] == 3 for d in described for f in d.get("metadata_frames", [])):
        with atp.open(path) as reader:  # groupings in the dataset's record numbering
            groups = reader.groups
            lines.append("groupings:")
            for name in groups:
                g = groups[name]
                roles = f"roles {', '.join(g.roles)}" if g.roles else "ordered"
                lines.append(f"  {name}: {len(g)} groups, {len(g.grouping.records)} members, "
                             f"{roles}; columns: {', '.join(g.grouping.properties) or 'none'}")
    return lines


def _cmd_verify(args: argparse.Namespace) -> int:
    from pyg_atompack.convert.summary import verify_source

    if _is_url(args.path):
        return _remote_verify(args)
    # a source that cannot be decoded at all is bad input (exit 2, one line); problems
    # found in a readable source (checksums, .atp records) are verify's report (exit 1)
    count, problems = verify_source(args.path, progress=_progress_factory(args.quiet),
                                    raise_unreadable=True)
    return _verify_report(args.path, count, problems)


def _cmd_push(args: argparse.Namespace) -> int:
    from huggingface_hub.utils import disable_progress_bars

    from pyg_atompack.hub import HubError, push

    disable_progress_bars()  # one bar for the whole upload instead of the client's per file
    byte_bar = _progress_factory(args.quiet, unit="B", unit_scale=True, desc="upload")
    try:
        result = push(args.source, args.repo_id, path_in_repo=args.path_in_repo or "",
                      revision=args.revision, private=args.private or None, create=args.create,
                      message=args.message, card_extra=args.card_extra,
                      overwrite_card=args.overwrite_card, license=args.license,
                      shard_size=args.shard_size, compression=args.compression,
                      level=args.level, read_options=_read_options(args),
                      src_format=args.src_format, progress=byte_bar,
                      convert_progress=_progress_factory(args.quiet))
    except HubError as exc:
        raise _Fail(str(exc)) from exc
    if not args.quiet:
        print(f"uploaded {len(result.uploaded)} file(s), {len(result.unchanged)} already "
              f"on the Hub, {len(result.deleted)} stale shard(s) deleted; card {result.card}")
    print(f"commit {result.commit}")
    print(result.uri)
    return EXIT_OK


def _cmd_pull(args: argparse.Namespace) -> int:
    from pyg_atompack.hub import HubError, pull
    from pyg_atompack.hub.pull import parse_pull_spec

    try:
        repo_id, path, revision = parse_pull_spec(args.spec)
        result = pull(repo_id, args.dest, path, revision=revision, pattern=args.pattern)
    except HubError as exc:
        raise _Fail(str(exc)) from exc
    if not args.quiet:
        print(f"{len(result.files)} file(s) verified at commit {result.commit}")
    print(result.root)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pyg-atompack`` (exposed for documentation and tests)."""
    from pyg_atompack import __version__

    parser = argparse.ArgumentParser(
        prog="pyg-atompack",
        description="Convert atomistic datasets to and from .atp, inspect and verify them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = commands.add_parser(
        "convert", help="convert SRC into DST (format from the suffix, or --from/--to)",
        description="Convert SRC (extxyz/ASE file or db, metatrain memmap directory or "
                    "DiskDataset .zip, PyG .pt, .atp) into DST (.atp file, .atp shard "
                    "directory with --shard-size, .pt shards, memmap directory, .xyz).")
    convert.add_argument("src", help="source file or directory")
    convert.add_argument("dst", help="destination file or directory (must not exist)")
    convert.add_argument("--to", metavar="FORMAT",
                         help="output format: atp, atp-shards, pt-shards, memmap, extxyz, or "
                              "one an installed plugin adds (see convert.formats())")
    convert.add_argument("--shard-size", type=int, metavar="N",
                         help="records per shard: write a shard directory + manifest.json")
    convert.add_argument("--compression", choices=("none", "lz4", "zstd"), default="none",
                         help=".atp codec (default: none)")
    convert.add_argument("--level", type=int, default=3, help="zstd level (default: 3)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    convert.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    convert.add_argument("--workers", type=_positive, default=1, metavar="N",
                         help="processes reading and parsing SRC; the output is the same as "
                              "with 1 (default: 1)")
    convert.add_argument("--part", metavar="I/N",
                         help="convert only part I of N (whole shards) into a shard directory; "
                              "combine the parts with `pyg-atompack merge`")
    _add_key_options(convert)
    _add_type_options(convert)
    convert.set_defaults(run=_cmd_convert)

    merge = commands.add_parser(
        "merge", help="combine the parts of convert --part I/N into one shard directory",
        description="Check that PART_DIRS are parts 0..N-1 of one conversion, verify "
                    "every shard (size, sha256), and write OUT with all shards (hard "
                    "links or copies) and one manifest.json in global order.")
    merge.add_argument("out", help="merged directory (must not exist)")
    merge.add_argument("parts", nargs="+", metavar="PART_DIR", help="part directories")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    merge.add_argument("-q", "--quiet", action="store_true", help="no summary")
    merge.set_defaults(run=_cmd_merge)

    info = commands.add_parser("info", help="counts, fields, codec, size, shard list",
                               description="Describe a dataset in any readable format.")
    info.add_argument("path", help="file, directory or URL (hf://, http(s)://, s3:// ...)")
    info.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    info.set_defaults(run=_cmd_info)

    verify = commands.add_parser(
        "verify", help="check headers, schema, index, manifest checksums, every record",
        description="Verify a dataset: for .atp both header slots, the schema and index; "
                    "manifest checksums of shard directories; then decode every record. "
                    "Exit status 1 with one line per problem.")
    verify.add_argument("path", help="file, directory or URL (hf://, http(s)://, s3:// ...)")
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    verify.set_defaults(run=_cmd_verify)

    shard = commands.add_parser(
        "shard", help="cut a dataset (.atp) into .pt shards for streaming",
        description="Write SRC as .pt shards (list[Data], tensors owning their storage) "
                    "plus manifest.json into OUT_DIR.")
    shard.add_argument("src", help="source (.atp file or shard directory, or any format)")
    shard.add_argument("out_dir", help="destination directory (must not exist)")
    shard.add_argument("--shard-size", type=int, required=True, metavar="N",
                       help="structures per shard")
    shard.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    shard.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    shard.set_defaults(run=_cmd_shard)

    head = commands.add_parser("head", help="print the first structures",
                               description="Print one line per structure for the first N.")
    head.add_argument("path", help="file, directory or URL (hf://, http(s)://, s3:// ...)")
    head.add_argument("-n", type=int, default=5, metavar="N",
                      help="number of structures (default: 5)")
    _add_key_options(head)
    head.set_defaults(run=_cmd_head)

    push = commands.add_parser(
        "push", help="publish a dataset to the Hugging Face Hub (shards, manifest, card)",
        description="Verify SOURCE (an .atp file, a directory of .atp or .pt shards, or "
                    "anything convert reads, converted to .atp shards first), write its "
                    "manifest.json and a dataset card, and upload them to the dataset "
                    "repository REPO_ID in one commit. Re-running an interrupted push "
                    "uploads only what is missing. Prints the commit and the hf:// URI "
                    "to pin.")
    push.add_argument("source", help="file or directory to publish")
    push.add_argument("repo_id", help="dataset repository, owner/name")
    push.add_argument("--path-in-repo", metavar="P", default="",
                      help="directory of the shards in the repository (default: the root)")
    push.add_argument("--revision", metavar="BRANCH", default="main",
                      help="branch to commit to (default: main)")
    push.add_argument("--private", action="store_true",
                      help="make a repository created by --create private")
    push.add_argument("--create", action="store_true",
                      help="create the dataset repository if it does not exist")
    push.add_argument("--message", "-m", metavar="M", help="commit message")
    push.add_argument("--card-extra", metavar="FILE",
                      help="text (source, citation) added to the dataset card")
    push.add_argument("--overwrite-card", action="store_true",
                      help="replace a README.md written by hand with the generated card")
    push.add_argument("--license", metavar="ID",
                      help="license id for the card (default: keep the card's, or 'other')")
    push.add_argument("--shard-size", type=int, metavar="N",
                      help="structures per shard when converting (default: 1000); given for "
                           "an .atp/.pt source, it is re-sharded instead of published as is")
    push.add_argument("--compression", choices=("none", "lz4", "zstd"),
                      help="codec of converted shards (default: zstd); given for an .atp/.pt "
                           "source, it is re-written instead of published as is")
    push.add_argument("--level", type=int, default=3, help="zstd level (default: 3)")
    push.add_argument("-q", "--quiet", action="store_true", help="no progress bars or summary")
    _add_key_options(push)
    push.set_defaults(run=_cmd_push)

    pull = commands.add_parser(
        "pull", help="download a published dataset (verified) into a directory",
        description="Download REPO_ID[/PATH][@REV] (or an hf:// URI) with "
                    "huggingface_hub's snapshot_download into DEST and check every file "
                    "against the listing's size and sha256.")
    pull.add_argument("spec", metavar="REPO_ID[/PATH][@REV]", help="what to download")
    pull.add_argument("dest", help="local directory")
    pull.add_argument("--pattern", default="*",
                      help="fnmatch pattern relative to PATH (default: every file)")
    pull.add_argument("-q", "--quiet", action="store_true", help="no summary line")
    pull.set_defaults(run=_cmd_pull)
    return parser


@contextlib.contextmanager
def _notes_on_stderr() -> Iterator[None]:
    """Print each :class:`~pyg_atompack.convert.ConversionNote` once, as one line."""
    from pyg_atompack.convert import ConversionNote

    shown: set[str] = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ConversionNote):
            return original(message, category, filename, lineno, file, line)
        if str(message) not in shown:
            shown.add(str(message))
            print(f"pyg-atompack: note: {message}", file=sys.stderr)
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("always", ConversionNote)
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv (Sequence[str], optional): Arguments without the program name
            (default: :obj:`sys.argv[1:]`).

    Returns:
        The exit code.
    """
    args = build_parser().parse_args(argv)
    from pyg_atompack.convert import ConvertError
    from pyg_atompack.hub import HubError
    from pyg_atompack.transport import TransportError

    expected: tuple[type[BaseException], ...] = (ConvertError, _Fail, HubError, TransportError)
    try:
        from pyg_atompack.atp import AtpError

        expected += (AtpError,)
    except ImportError:
        pass
    try:
        with _notes_on_stderr():
            return args.run(args)
    except expected as exc:
        print(f"pyg-atompack: error: {exc}", file=sys.stderr)
        return getattr(exc, "code", EXIT_BAD_INPUT)
    except BrokenPipeError:
        # the reader of our output went away (e.g. `| head`): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("pyg-atompack: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
