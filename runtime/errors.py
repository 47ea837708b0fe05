"""One error hierarchy for the whole tool.

Every error a user can cause (a bad file, a bad flag value, a budget that cannot work) is an
``S2MoEError``: the CLIs print its message as one line on stderr and exit with its ``exit_code``.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class S2MoEError(Exception):
    """Base class: a problem the user can fix. The message names the file/field and the fix."""

    exit_code = 2


class ModelFormatError(S2MoEError):
    """A model file or folder is missing, truncated, malformed or inconsistent with its config."""


class UnsupportedModelError(S2MoEError):
    """A well-formed model of an architecture or tensor type this runtime does not implement."""


class UsageError(S2MoEError):
    """A command-line value that cannot work (bad budget string, unknown method, …)."""


class KVCacheError(S2MoEError):
    """An invalid KV-cache request (rollback past the committed length, overflow, gap)."""

    exit_code = 3


class ExpertReadError(S2MoEError):
    """Reading an expert's bytes from the model file failed (short read, I/O error, file changed)."""

    exit_code = 4
