"""Output folders written all-or-none: a run owns its folder and replaces it whole.

Every file of a run, and a ``manifest.json`` naming them with the run's settings, is written into a
temporary folder beside ``--out``; only when all are complete does one rename put the folder in
place (an atomic exchange with the old one where the OS has it), so ``--out`` holds either the
complete old output or the complete new one, never a mix and never a stale file of an earlier run.
A temporary folder that a killed run left behind is removed by the next run into the same place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import Refused, UserError, check_signalled, signals_held

MANIFEST = "manifest.json"
# What fxworkload writes into an output folder: a folder holding only these may be replaced.
OUR_FILES = frozenset({MANIFEST, "workload.tsv", "nodes.tsv", "workload.json", "workload.simai.txt", "workload.trace.json",
                       "workload.comm_groups.json",
                       "measured.tsv", "measured.json", "comparison.json", "comparison.txt", "comparison.png",
                       "plan.json", "plan.txt"})
CHAKRA_FILE = re.compile(r"^workload\.\d+\.et$")  # one Chakra execution trace per rank


def is_ours(name: str) -> bool:
    return name in OUR_FILES or bool(CHAKRA_FILE.match(name))


_TEMP = re.compile(r"^\.(?P<name>.+)\.fxworkload-(?P<pid>\d+)-[A-Za-z0-9_]+$")


def followed(out: Path) -> Path:
    """A symbolic link given as --out is followed: the run replaces the folder it points to, the link stays."""
    try:
        return Path(os.path.realpath(out)) if out.is_symlink() else out
    except OSError:  # a name too long, a loop: check_out_dir names the problem
        return out


def check_out_dir(out: Path) -> None:
    """Fail before any work if ``out`` cannot become this run's folder (nothing is created)."""
    if str(out) == "":
        raise UserError("--out is empty; give a folder name, e.g. --out outputs/run1")
    out = followed(out)
    existing = out
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    longest = max(out.parts, key=lambda part: len(os.fsencode(part)), default="")
    if len(os.fsencode(longest)) > _name_max(existing):
        raise UserError(f"--out {str(out)[:60]}...: a name in it is longer than the {_name_max(existing)} bytes the "
                        "file system allows; choose a shorter --out")
    if existing != out:
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            if not existing.is_dir():
                raise UserError(f"cannot write to output folder {out} (a file is in the way: {existing}); "
                                "choose another --out")
            raise Refused(f"cannot write to output folder {out} (not writable: {existing}); choose another --out")
        return
    if not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder; choose another --out")
    parent = out.resolve().parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Refused(f"cannot replace output folder {out} (its parent {parent} is not writable); choose another --out")
    foreign = sorted(entry.name for entry in _entries(out) if not is_ours(entry.name) or not entry.is_file())
    if foreign:
        raise UserError(f"--out {out} holds files fxworkload did not write ({foreign[0]}"
                        f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); a run replaces its "
                        "whole output folder: choose a new or empty folder")


def publish(out: Path, contents: dict[str, str | bytes], settings: dict) -> list[Path]:
    """Replace ``out`` with a folder holding exactly ``contents`` and a manifest of them; all or none."""
    check_out_dir(out)
    given, out = out, followed(out)
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.fxworkload-{os.getpid()}-"))
    except OSError as exc:
        raise Refused(f"cannot write to output folder {out} ({_reason(exc)}); choose another --out") from None
    try:
        for name, content in contents.items():
            _write(staging / name, content)
        _write(staging / MANIFEST, manifest_text(contents, settings))
        os.chmod(staging, 0o777 & ~_umask())
        check_signalled()  # a Ctrl-C that a library swallowed earlier still keeps the old output
        with _sigint_deferred():  # the swap and the removal of the old folder run to the end
            _swap_into_place(staging, out)
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise Refused(f"cannot write to output folder {out} ({_reason(exc)}); nothing was changed there; "
                        "free space or choose another --out") from None
    finally:  # also on Ctrl-C while the files are written: no temporary folder is left behind
        with _sigint_deferred():
            shutil.rmtree(staging, ignore_errors=True)
    return [given / name for name in [*contents, MANIFEST]]


def _sigint_deferred():
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block ends, then raise them: a swap or clean-up is never cut in half."""
    return signals_held()


def manifest_text(contents: dict[str, str | bytes], settings: dict) -> str:
    """What the run wrote (bytes and SHA-256 of each file) and with which settings; no timestamps,
    so that the same command writes the same manifest."""
    files = {}
    for name, content in sorted(contents.items()):
        data = content.encode() if isinstance(content, str) else content
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return json.dumps({"fxworkload_manifest": 1, "settings": settings, "files": files}, indent=1) + "\n"


def read_manifest(folder: Path) -> dict | None:
    """The manifest.json of an output folder, or None where there is none (or it is not ours)."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def check_one_run(path: Path) -> None:
    """A file whose folder's manifest lists it with other content was put there by another run."""
    manifest = read_manifest(path.parent)
    entry = manifest["files"].get(path.name) if manifest else None
    if isinstance(entry, dict) and entry.get("sha256") != hashlib.sha256(path.read_bytes()).hexdigest():
        raise UserError(f"{path} is not the file the run recorded in {path.parent / MANIFEST} wrote "
                        "(copied in from another run, or edited); pass the folder of one run")


def write_file(path: Path, content: str | bytes, option: str = "--plot") -> Path:
    """One regular file, written to a temporary name beside it and renamed into place."""
    if _exists(path) and (not path.is_file() or path.is_symlink()):
        raise UserError(f"{option} {path} exists and is not a regular file; choose another {option} path")
    parent = path.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise Refused(f"cannot write {option} {path} ({_reason(exc)}); choose another {option} path") from None
    try:
        os.close(fd)
        _write(Path(tmp), content)
        os.replace(tmp, path)
    except OSError as exc:
        raise Refused(f"cannot write {option} {path} ({_reason(exc)}); choose another {option} path") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def remove_stale_temps(out: Path) -> None:
    """Temporary folders of runs into ``out`` that were killed (their process is gone)."""
    parent = out.absolute().parent
    try:
        candidates = list(parent.iterdir())
    except OSError:
        return
    for entry in candidates:
        found = _TEMP.match(entry.name)
        if found and found["name"] == out.name and not _alive(int(found["pid"])):
            shutil.rmtree(entry, ignore_errors=True)


def _write(path: Path, content: str | bytes) -> None:
    data = content.encode() if isinstance(content, str) else content
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o666 & ~_umask())


def _swap_into_place(staging: Path, out: Path) -> None:
    """After this, ``staging`` holds the old output (or nothing) and ``out`` the new one."""
    if not _exists(out):
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        return
    old = staging.with_name(staging.name + "-old")  # no atomic exchange here: two renames
    os.rename(out, old)
    os.rename(staging, out)
    os.rename(old, staging)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux's renameat2(RENAME_EXCHANGE); False where unavailable."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # kernel or filesystem without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError as exc:
        raise Refused(f"cannot read output folder {folder} ({_reason(exc)}); choose another --out") from None


def _exists(path: Path) -> bool:
    try:
        return path.exists() or path.is_symlink()
    except OSError:
        return False


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
