"""The operator's inferlet folder: which names can be launched, and nothing else.

Owns: turning a launch name into a file inside the folder. Hosted code runs with the
server's rights, so this is the security boundary of hosting (docs/inferlets.md): a name
is ``[A-Za-z0-9_-]`` words joined by ``/`` (optionally ending in ``.py``); it resolves to
``DIR/NAME.py`` only if that file, with every symlink followed, is still inside ``DIR``.
Absolute paths, ``..``, hidden names and symlinks that lead out are refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pie_ctx.proto.errors import InferletNotFound, InvalidArgument

__all__ = ["InferletFolder"]

_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
_MAX_DEPTH = 8


class InferletFolder:
    """The folder of launchable inferlets.

    Args:
        path: an existing folder.

    Raises:
        InvalidArgument: ``path`` is not a folder.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise InvalidArgument(f"--inferlets {folder}: not a folder; create it and put "
                                  "inferlet files (NAME.py with async def main(rt, args)) in it")
        self.path = folder.resolve()

    def names(self) -> list[str]:
        """The launchable names (files ``*.py`` directly inside the folder, sorted)."""
        found = []
        for entry in sorted(self.path.glob("*.py")):
            try:
                self._inside(entry)
            except InferletNotFound:
                continue
            if _WORD.fullmatch(entry.stem):
                found.append(entry.stem)
        return found

    def resolve(self, name: str) -> Path:
        """The file of the inferlet ``name``.

        Raises:
            InferletNotFound: the name is malformed, leaves the folder (``..``, an absolute
                path, a symlink out), or names no file; the message lists what is there.
        """
        if not isinstance(name, str):
            raise InferletNotFound(f"an inferlet name is a str, got {type(name).__name__}")
        words = name.removesuffix(".py").split("/")
        if len(words) > _MAX_DEPTH or not all(_WORD.fullmatch(w) for w in words):
            raise InferletNotFound(
                f"inferlet name {name!r} is refused: use the file's name inside the inferlet "
                "folder, words of A-Z a-z 0-9 _ - joined by / (no '..', no absolute path); "
                f"launchable: {self._listing()}")
        file = self.path.joinpath(*words[:-1], words[-1] + ".py")
        self._inside(file, name)
        if not file.is_file():
            raise InferletNotFound(f"no inferlet {name!r} in {self.path}; launchable: "
                                   f"{self._listing()}")
        return file

    def _inside(self, file: Path, name: str | None = None) -> None:
        real = Path(os.path.realpath(file))
        if not real.is_relative_to(self.path):
            raise InferletNotFound(
                f"inferlet {name or file.name!r} is refused: it leads out of the inferlet "
                f"folder {self.path} (a symlink to {real}); only files inside it can be launched")

    def _listing(self) -> str:
        names = self.names()
        return ", ".join(names) if names else "(none)"
