"""The cache folder: JSON data only, in a folder no other user can write, each entry checked where it is read.

Every cache of the package (captured steps, a model's facts, a plan's rows, measured device profiles)
lives under ``cache_dir()``. Three rules keep a cache from being a way into the user's account or
a way to change a run's results:

- **Data, not code.** Entries are JSON (``records.py`` reads them back into named dataclasses, field by
  field); nothing read from the cache can name code to run. Non-finite numbers are refused on write and read.
- **A folder only the user (or root) can write.** As OpenSSH refuses a key file others can change
  (``safe_path()`` in its misc.c), a cache folder, or any folder above it, that another user owns or can
  write is refused with one line naming it and the fix. A folder above it may be world-writable only
  with the sticky bit (``/tmp``): then no other user can rename or replace what is in it. A folder
  writable by its group is allowed only where that group is the user's own private group.
- **Each entry says what it is.** An entry carries its schema, kind and the key it was written under;
  a file whose kind or key differs (copied over another key, swapped, truncated, from an older
  release) is not used: the work is done again, and ``--verbose`` says why.

Temporary files are created exclusively (``mkstemp``: ``O_CREAT | O_EXCL``, mode 0600) and renamed
into place, so concurrent runs never write into each other's file and a reader never sees half of one.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

from .errors import UserError

SCHEMA = 1  # the layout of every entry: {"schema", "kind", "key", "data"}
MAX_ENTRY_BYTES = 1 << 30  # larger than any entry this package writes (a 405B capture is a few MB)

_NOTES: list[str] = []  # why entries were not used, for --verbose


def cache_dir() -> Path:
    root = os.environ.get("FXWORKLOAD_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fxworkload"
    return Path(root)


def folder(*parts: str, create: bool = False) -> Path | None:
    """The cache folder (or one inside it), checked; None when it does not exist and ``create`` is off.
    Raises UserError when another user owns or can write it or a folder above it."""
    path = cache_dir().joinpath(*parts)
    if create:
        try:  # the cache folder and those inside it: the user's alone (parents=True gives new parents 0777 - umask)
            cache_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            pass  # an unwritable cache only costs the work next time; the check below still runs
    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if existing is not None:  # the folder, or the nearest one above it that someone could create it in
        check_folder(existing)
    return path if existing == path else None


def check_folder(path: Path) -> None:
    """The folder and every folder above it are safe to read code-free data from (see the module)."""
    real = Path(os.path.realpath(path))
    root = Path(os.path.realpath(cache_dir()))
    for at in (real, *real.parents):
        try:
            info = os.stat(at)
        except OSError:
            continue
        trusted = {os.geteuid(), 0}
        below_cache = at == root or root in at.parents  # the cache's own folders: closed to others, sticky or not
        if info.st_uid not in trusted:
            raise UserError(f"cache folder {at} belongs to another user (uid {info.st_uid}): whoever owns it could "
                            "change what this run reads; point FXWORKLOAD_CACHE_DIR at a folder of your own")
        others_write = info.st_mode & stat.S_IWOTH
        group_write = info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid)
        if (others_write or group_write) and (below_cache or not info.st_mode & stat.S_ISVTX):
            who = "every user" if others_write else "its group"
            raise UserError(f"cache folder {at} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o}): anyone "
                            f"who can write there could change what this run reads; run 'chmod go-w {at}' or point "
                            "FXWORKLOAD_CACHE_DIR at a folder of your own")


@functools.cache
def _private_group(gid: int) -> bool:
    """The user's own group: no other member, and no other user's primary group."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.geteuid()).pw_name
        if set(grp.getgrgid(gid).gr_mem) - {me}:
            return False
        return all(user.pw_uid == os.geteuid() for user in pwd.getpwall() if user.pw_gid == gid)
    except (ImportError, KeyError, OSError):
        return False


def read(path: Path, kind: str, key: str):
    """The data of the entry at ``path`` if it is a ``kind`` entry written under ``key`` by this user (or
    root), else None (with a note saying why, unless the file is simply absent)."""
    if folder(*path.parent.relative_to(cache_dir()).parts) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _skip(path, f"cannot be opened ({exc.strerror})")
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return _skip(path, "is not a regular file")
        if info.st_uid not in (os.geteuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return _skip(path, "was written by another user or can be changed by one")
        if info.st_size > MAX_ENTRY_BYTES:
            return _skip(path, f"is larger than {MAX_ENTRY_BYTES:,} bytes")
        try:
            raw = f.read()
        except OSError as exc:
            return _skip(path, f"cannot be read ({exc.strerror})")
    try:
        entry = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        return _skip(path, f"is not JSON ({str(exc)[:80]})")
    if not isinstance(entry, dict) or set(entry) != {"schema", "kind", "key", "data"}:
        return _skip(path, "is not a cache entry")
    if entry["schema"] != SCHEMA or entry["kind"] != kind:
        return _skip(path, f"holds a {entry['kind']!r} entry of schema {entry['schema']!r}, not a {kind!r} "
                           f"entry of schema {SCHEMA}")
    if entry["key"] != key:
        return _skip(path, "was written for another key (copied or swapped)")
    return entry["data"]


def write(path: Path, kind: str, key: str, data) -> None:
    """Write the entry atomically; an unwritable cache (or data JSON cannot hold) only costs the work next time."""
    if folder(*path.parent.relative_to(cache_dir()).parts, create=True) is None:
        return
    try:
        # keys in the order given (not sorted): what is read back is the data as it was, dict order included
        # (a table's files list an op's attention facts in their order; a cached run writes the same bytes)
        text = json.dumps({"schema": SCHEMA, "kind": kind, "key": key, "data": data},
                          separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        note(f"cache: {path.name} not written ({exc})")
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def note(text: str) -> None:
    _NOTES.append(text)
    if os.environ.get("FXWORKLOAD_VERBOSE"):
        print(f"fxworkload: {text}", file=sys.stderr, flush=True)


def _skip(path: Path, why: str):
    note(f"cache: {path} {why}: not used, the work is done again")
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")
