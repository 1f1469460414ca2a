"""The UI's errors: library errors that carry the HTTP status the API answers with."""

from __future__ import annotations

from lorafuse.errors import LorafuseError


class UIError(LorafuseError):
    """A request the UI cannot serve; ``status`` is the HTTP status, the message its ``detail``."""

    status = 400


class BadRequest(UIError):
    status = 400


class Unauthorized(UIError):
    status = 401


class Forbidden(UIError):
    status = 403


class NotFound(UIError):
    status = 404


class Conflict(UIError):
    status = 409
