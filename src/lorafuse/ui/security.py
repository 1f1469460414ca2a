"""Who may talk to the UI server and which files the page may name.

* **Token**: a loopback bind without ``--token`` needs none. Any other bind (or an explicit token)
  requires it on every ``/api`` call, as ``Authorization: Bearer <t>`` or ``?token=<t>``
  (EventSource cannot set headers): missing -> 401, wrong -> 403. Compared in constant time.
* **Host**: the ``Host`` header must name the bound host or a loopback name (DNS rebinding: a
  hostile page whose domain resolves to 127.0.0.1 sends its own name as Host) -> 403.
* **Origin**: a state-changing request (POST, PUT, PATCH, DELETE) carrying an ``Origin`` that is
  not this server's -> 403 (cross-site form posts and fetches from other pages).
* **Paths**: every path from the page is relative to the workspace (or absolute inside it);
  ``..`` components, absolute paths outside, and symlinks that lead out are refused.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from lorafuse.ui.errors import BadRequest, Forbidden, Unauthorized

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token: str | None) -> str | None:
    """The token the server requires: the given one, none on loopback, else a fresh random one."""
    if token:
        return token
    if is_loopback(host):
        return None
    return secrets.token_urlsafe(24)


class Guard:
    """The request checks of one server: bound host, token (or None), allowed Host names."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self.host = host
        self.port = port
        self.token = token
        names = {host.strip("[]").lower(), *(n.strip("[]") for n in LOOPBACK_NAMES)}
        if host in ("0.0.0.0", "::"):  # bound everywhere: any name may reach it; the token guards
            names = set()
        self.host_names = names

    def check_host(self, host_header: str | None) -> None:
        if not self.host_names:
            return
        name = _host_name(host_header or "")
        if name not in self.host_names:
            raise Forbidden(f"Host {host_header!r} is not this server ({self.host})")

    def check_origin(self, method: str, origin: str | None, host_header: str | None) -> None:
        """A foreign ``Origin`` on a state-changing request is refused (no CORS here)."""
        if method.upper() not in STATE_CHANGING or not origin:
            return
        parts = urlsplit(origin)
        if parts.netloc.lower() != (host_header or "").lower():
            raise Forbidden(f"Origin {origin!r} may not change state on this server")

    def check_token(self, authorization: str | None, query_token: str | None) -> None:
        if self.token is None:
            return
        given = None
        if authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        elif query_token:
            given = query_token
        if not given:
            raise Unauthorized("this server needs its token: Authorization: Bearer <t> or ?token=")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Forbidden("wrong token")


def _host_name(host_header: str) -> str:
    """``example.com:7860`` -> ``example.com``; ``[::1]:7860`` -> ``::1``."""
    host_header = host_header.strip().lower()
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def resolve_in(root: str | os.PathLike, path: str, *, must_exist: bool = False) -> Path:
    """``path`` (relative to ``root``, or absolute inside it) as a real path inside ``root``.

    Refused with 400: empty paths, NUL bytes, ``..`` components. Refused with 403: absolute paths
    outside ``root`` and symlinks whose target leaves it (both sides are fully resolved, so a
    link chain cannot escape). ``must_exist``: 404-style ``BadRequest`` when it is missing.
    """
    if not isinstance(path, str) or not path.strip():
        raise BadRequest("empty path")
    if "\x00" in path:
        raise BadRequest(f"path {path!r} contains a NUL byte")
    if ".." in Path(path).parts or ".." in path.replace("\\", "/").split("/"):
        raise BadRequest(f"path {path!r}: '..' is not allowed")
    base = Path(root).resolve()
    candidate = Path(path) if os.path.isabs(path) else base / path
    real = candidate.resolve()
    if real != base and base not in real.parents:
        raise Forbidden(f"path {path!r} is outside the workspace {base}")
    if must_exist and not real.exists():
        raise BadRequest(f"{path}: no such file or directory in the workspace")
    return real


def relative(root: str | os.PathLike, path: str | os.PathLike) -> str:
    """``path`` relative to ``root`` (for responses: the page never sees absolute paths)."""
    return str(Path(path).resolve().relative_to(Path(root).resolve()))
