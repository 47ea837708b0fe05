"""Files s2moe writes: checked before the work starts, written whole or not at all, with the mode
the user's umask gives any new file.

Every command that writes (convert's GGUF, bench's JSON and CSV, profiles) checks its output path
first with `check_output`, so a path that cannot work fails in one line before minutes of work:
an input file of the same run, an existing file that must not be replaced, a missing or read-only
folder. `write_atomic` then writes a temporary file beside the target, syncs it and renames it over.
"""

from __future__ import annotations

import os
import tempfile

from .errors import UsageError


def umask_mode(base: int = 0o666) -> int:
    """``base`` less the process umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def check_output(path: str, flag: str, inputs=(), replace: bool = True, force: bool = False) -> str:
    """``path`` as given, once it is known to be writable. ``inputs``: files this run reads (writing
    over one destroys the run's own input). ``replace=False``: an existing file needs ``force``."""
    where = f"{flag} {path}"
    if os.path.isdir(path):
        raise UsageError(f"{where}: is a folder; name a file")
    if os.path.exists(path):
        for inp in inputs:
            if os.path.exists(inp) and os.path.samefile(path, inp):
                raise UsageError(f"{where}: that is an input of this run ({inp}); write somewhere else")
        if not replace and not force:
            raise UsageError(f"{where}: exists; pass --force to replace it, or choose another path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{where}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: cannot write in {folder} (permission denied); choose another path")
    return path


def temp_beside(path: str, suffix: str) -> str:
    """A new temporary file in ``path``'s folder (so the rename is atomic), closed, mode 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".s2moe-", suffix=suffix, dir=folder)
    except OSError as exc:  # name the user's path, not the temporary one
        raise UsageError(f"{path}: cannot write in {folder} ({exc.strerror or exc}); choose another path") from None
    os.close(fd)
    return tmp


def publish(tmp: str, path: str) -> None:
    """Give the finished temporary file the umask's mode and rename it over ``path``."""
    os.chmod(tmp, umask_mode())
    os.replace(tmp, path)


def write_atomic(path: str, text: str) -> None:
    tmp = temp_beside(path, ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
