"""The one user-facing error type. Library code raises it (or a subclass) with a message that names
the problem and the file; only ``lorafuse.commands`` turns it into one line and an exit status.
"""

from __future__ import annotations


class LorafuseError(Exception):
    """A problem the user can fix (bad input, missing file, impossible request): printed as one line,
    exit status 2. Subclasses name the area (``DataError``, ``ConfigError``, ``ModelSourceError``...)."""


class SettingError(LorafuseError, ValueError):
    """An environment variable or argument naming a setting holds a value it cannot take
    (``LORAFUSE_KERNELS=cuda``). A ``ValueError`` too, for callers that caught that before."""


class ConfigError(LorafuseError, ValueError):
    """An invalid setting; the message names the field (re-exported by ``lorafuse.train.config``)."""


class GGUFExportError(LorafuseError, ValueError):
    """The model or tokenizer cannot be exported to GGUF (raised before anything is written);
    here, below both ``export.gguf_vocab`` and ``export.gguf_pretokenizer``, which use it."""
