"""Checkpoint file systems by name: the built-ins (local, hdfs, s3, gcs, with their options as data) and
the plugins a cluster admin installed (Python entry points, group `megascale.filesystems`).

A job spec names a file system and gives it plain options; it never names code. The operator, driver,
executors and keepers read job specs written by people they do not trust, so nothing here imports a
module a spec names: a name that is neither a built-in nor an installed plugin is refused.

A plugin is `factory(uri: str, options: dict[str, str]) -> (pyarrow FileSystem, path)`, registered as
e.g. `[project.entry-points."megascale.filesystems"] myfs = "mypkg.fs:make"`; built-in names win.

No torch and no megascale imports here: the config validates through this module, and keepers start fast.
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlparse

GROUP = "megascale.filesystems"
# What checkpoint.filesystem may be (the CRD's pattern too): a plain name, never a module path or file.
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
FIELD, OPTIONS = "checkpoint.filesystem", "checkpoint.filesystem_options"


class UnknownFilesystem(ValueError):
    """A checkpoint.filesystem or option that cannot be used; the message is one line naming the field."""


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError("must be true or false")
    return lowered == "true"


def _seconds(text: str) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(text))


@dataclass(frozen=True)
class Builtin:
    schemes: tuple[str, ...]  # checkpoint.uri schemes it serves ("" = a local path)
    options: dict[str, Callable[[str], Any]]  # option -> its parser (text from the config to the value)
    make: Callable[[Any, dict], tuple[Any, str]]  # (parsed uri, parsed options) -> (FileSystem, path)


def _local(uri, options: dict):
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem(), uri.path


def _hdfs(uri, options: dict):
    import pyarrow.fs as pafs

    return pafs.HadoopFileSystem(uri.hostname or "default", uri.port or 8020, **options), uri.path


def _s3(uri, options: dict):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(**options), uri.netloc + uri.path


def _gcs(uri, options: dict):
    import pyarrow.fs as pafs

    return pafs.GcsFileSystem(**options), uri.netloc + uri.path


# Credentials are not options: a job spec is readable by whoever can read the job. Each file system
# takes them from its environment (AWS/GCS credential chains, Kerberos) as pyarrow documents.
BUILTINS = {
    "local": Builtin(("", "file"), {}, _local),
    "hdfs": Builtin(("hdfs", "viewfs"), {"user": str, "replication": int, "buffer_size": int,
                                         "default_block_size": int, "kerb_ticket": str}, _hdfs),
    "s3": Builtin(("s3",), {"region": str, "endpoint_override": str, "scheme": str, "anonymous": _bool,
                            "request_timeout": float, "connect_timeout": float, "role_arn": str, "session_name": str,
                            "external_id": str, "background_writes": _bool, "force_virtual_addressing": _bool,
                            "allow_bucket_creation": _bool, "tls_ca_file_path": str}, _s3),
    "gcs": Builtin(("gs", "gcs"), {"anonymous": _bool, "target_service_account": str, "default_bucket_location": str,
                                   "scheme": str, "endpoint_override": str, "project_id": str,
                                   "retry_time_limit": _seconds}, _gcs),
}


def plugins() -> dict[str, EntryPoint]:
    """The file systems installed plugins register, by name (loading none of them)."""
    return {ep.name: ep for ep in entry_points(group=GROUP) if ep.name not in BUILTINS}


def _known() -> str:
    return ", ".join([*BUILTINS, *sorted(plugins())])


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else ""


def check(name: Optional[str], options: Mapping[str, str], uri: Optional[str] = None) -> None:
    """UnknownFilesystem (one line naming the field) unless `name` is a built-in or an installed plugin,
    a built-in's `options` are all its own and parse, and a built-in serves `uri`'s scheme."""
    _parsed(name, options, uri)


def _parsed(name: Optional[str], options: Mapping[str, str], uri: Optional[str]) -> dict:
    if name is None:
        if options:
            raise UnknownFilesystem(f"{OPTIONS}: needs {FIELD} (the file system the options are for)")
        return {}
    if not isinstance(name, str) or not NAME.match(name):
        raise UnknownFilesystem(f"{FIELD}={name!r}: must be the name of a registered file system ({_known()}); "
                                "code is never loaded from a job spec")
    builtin = BUILTINS.get(name)
    if builtin is None:
        if name not in plugins():
            raise UnknownFilesystem(f"{FIELD}={name!r}: no such file system (known: {_known()}; plugins register "
                                    f"in the Python entry point group {GROUP})")
        return dict(options)
    unknown = sorted(set(options) - set(builtin.options))
    if unknown:
        raise UnknownFilesystem(f"{OPTIONS}.{unknown[0]}: not an option of {FIELD}={name} "
                                f"(its options: {', '.join(builtin.options) or 'none'})")
    parsed = {}
    for option, text in options.items():
        try:
            parsed[option] = builtin.options[option](str(text))
        except ValueError as e:
            raise UnknownFilesystem(f"{OPTIONS}.{option}={text!r}: {e}") from None
    if uri is not None and _scheme(uri) not in builtin.schemes:
        wanted = " or ".join(f"{s}://" if s else "a local path" for s in builtin.schemes)
        raise UnknownFilesystem(f"{FIELD}={name}: checkpoint.uri={uri} is not {wanted}")
    return parsed


def open_filesystem(name: str, options: Mapping[str, str], uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, root path) of checkpoint.uri `uri` on the file system called `name`."""
    parsed = _parsed(name, options, uri)
    builtin = BUILTINS.get(name)
    if builtin is not None:
        return builtin.make(urlparse(uri), parsed)
    return plugins()[name].load()(uri, dict(options))
