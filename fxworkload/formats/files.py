"""All-or-none file writing into an output folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import UserError


def check_out_dir(out: Path) -> None:
    """Fail before any work if ``out`` cannot become a writable folder (nothing is created)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        reason = "a file is in the way" if existing.exists() and not existing.is_dir() else "not writable"
        raise UserError(f"cannot write to output folder {out} ({reason}: {existing}); choose another --out")


def prepare_out_dir(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".fxworkload-probe-")
        probe.close()
    except OSError as exc:
        raise UserError(f"cannot write to output folder {out} ({exc.strerror}); choose another --out") from None
    return out


def write_files(out: Path, contents: dict[str, str | bytes]) -> list[Path]:
    """Write every file to a temporary name first, then rename them all: no partial outputs."""
    temps = []
    try:
        for name, content in contents.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
            os.chmod(tmp, 0o666 & ~_umask())
            temps.append((Path(tmp), out / name))
        for tmp, final in temps:
            tmp.replace(final)
    except OSError as exc:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write to output folder {out} ({exc.strerror}); choose another --out") from None
    return [final for _, final in temps]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
