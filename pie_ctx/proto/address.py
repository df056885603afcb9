"""Where a server listens and how clients prove who they are: addresses and token files.

Addresses are strings: ``"unix:/path/to.sock"``, a plain path (also a Unix socket), or
``"tcp:HOST:PORT"`` (``"tcp:[::1]:PORT"`` for IPv6). The default Unix socket lives in the
user's runtime folder: ``$XDG_RUNTIME_DIR/pie-ctx`` when that variable names a folder,
else ``<tmp>/pie-ctx-<uid>``; the folder is created 0700 and refused if another user owns
it or others can enter it, because the socket itself carries no token.

Token files hold one token on one line; they are created 0600 and refused if other users
can read them. This module imports neither torch nor the engine (clients use it too).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pie_ctx.proto.errors import InvalidArgument

__all__ = [
    "Address",
    "parse_address",
    "runtime_dir",
    "default_socket_path",
    "default_token_file",
    "default_api_key_file",
    "new_token",
    "write_token_file",
    "read_token_file",
]


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed server address: ``kind`` is ``"unix"`` (``path``) or ``"tcp"`` (``host``, ``port``)."""

    kind: str
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp:{host}:{self.port}"


def parse_address(address: str | os.PathLike[str]) -> Address:
    """Parse ``"unix:PATH"``, ``"tcp:HOST:PORT"`` or a plain socket path.

    Raises:
        InvalidArgument: the address is empty or its port is not a number in [0, 65535].
    """
    text = os.fspath(address)
    if not isinstance(text, str) or not text:
        raise InvalidArgument("server address is empty; use unix:/path or tcp:127.0.0.1:PORT")
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise InvalidArgument(f"address {text!r} names no socket path")
        return Address("unix", path=path)
    if text.startswith("tcp:"):
        rest = text[len("tcp:"):]
        host, sep, port_text = rest.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
            raise InvalidArgument(
                f"address {text!r} is not tcp:HOST:PORT (e.g. tcp:127.0.0.1:7777)"
            )
        return Address("tcp", host=host, port=int(port_text))
    return Address("unix", path=text)


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise InvalidArgument(f"{path} belongs to another user; pick another --socket path")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def runtime_dir() -> Path:
    """The per-user private folder for sockets and token files (created 0700)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return _private_dir(Path(xdg) / "pie-ctx")
    return _private_dir(Path(tempfile.gettempdir()) / f"pie-ctx-{os.getuid()}")


def default_socket_path() -> str:
    """The Unix socket ``pie-ctx serve`` listens on when given no address."""
    return str(runtime_dir() / "engine.sock")


def default_token_file() -> str:
    """Where ``pie-ctx serve`` writes a generated TCP token when given no ``--token-file``."""
    return str(runtime_dir() / "tcp.token")


def default_api_key_file() -> str:
    """Where ``pie-ctx serve --http`` writes a generated API key when given no
    ``--api-key-file``."""
    return str(runtime_dir() / "http.key")


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | os.PathLike[str], token: str) -> None:
    """Write ``token`` to ``path``, created (or reset to) mode 0600.

    Raises:
        InvalidArgument: the token is empty or holds whitespace.
    """
    if not token or any(c.isspace() for c in token):
        raise InvalidArgument("a token must be non-empty and hold no whitespace")
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """Read the token stored in ``path``.

    Raises:
        InvalidArgument: the file is missing, empty, or readable by other users.
    """
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as err:
        raise InvalidArgument(f"cannot read token file {p}: {err.strerror}") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise InvalidArgument(f"token file {p} is accessible to other users; chmod 600 it")
    if not text:
        raise InvalidArgument(f"token file {p} is empty")
    return text
