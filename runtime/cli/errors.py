"""Error table shared by both CLIs: exception type → one line on stderr + exit code.

`S2MOE_DEBUG=1` re-raises instead, so the traceback is there when a developer wants it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import typer

from ..errors import S2MoEError

# (exception type, exit code, hint naming the next command). First match wins; an S2MoEError
# carries its own exit code (2 bad input, 3 KV cache, 4 expert read).
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (S2MoEError, 2, ""),
    (FileNotFoundError, 2, "check the path"),
    (PermissionError, 2, "check the file's permissions"),
    (IsADirectoryError, 2, "pass a file, not a folder"),
    (MemoryError, 5, "lower --budget or --max-tokens"),
    (OSError, 4, "check the disk and the file"),
]


def debug_enabled() -> bool:
    return os.environ.get("S2MOE_DEBUG", "") not in ("", "0")


def report(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


@contextmanager
def cli_errors():
    try:
        yield
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        report("interrupted")
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except BaseException as exc:
        if debug_enabled():
            raise
        for kind, code, hint in ERROR_TABLE:
            if isinstance(exc, kind):
                text = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
                if isinstance(exc, OSError) and exc.filename and exc.strerror:
                    text = f"{exc.filename}: {exc.strerror}"
                report(text + (f" ({hint})" if hint else ""))
                raise typer.Exit(getattr(exc, "exit_code", code)) from None
        raise
