"""Where adapters may be read from at run time: the folders the operator names (--lora-root, like vLLM's LoRA
resolver folders), and the names an adapter may be offered under.

A runtime load names its folder (`lora_path`): an absolute path, or one relative to the roots (the first root
that holds it). The folder and each file read from it must lie inside a root once symlinks are resolved, so
neither `..` nor a link leads out. Every refusal reads the same whether the path is outside the roots, absent,
or not a folder: an answer must not tell a client what exists where it may not look.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# A model name: what clients send as `model`, never a path (no separators, no leading dot).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "1 to 128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"


def check_adapter_name(name: object) -> str:
    """`name` if it may name an adapter; raises ValueError saying what a name may hold."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"lora_name must be {NAME_RULE}, got {name!r}")
    return name


def outside_message(path: str) -> str:
    """The one refusal of a path that is not an adapter folder under the roots, whatever the reason."""
    return f"lora_path {path!r} is not a folder under this server's --lora-root folders"


class LoRARoots:
    """The operator's adapter folders, resolved once at start-up."""

    def __init__(self, roots: tuple[str, ...] | list[str], must_exist: bool = True) -> None:
        """`must_exist`: each root must be a folder here (an engine's); the proxy, which may not see the
        adapters' files, checks paths by their text only (`lexically_inside`)."""
        self.named = tuple(os.path.normpath(os.path.abspath(root)) for root in roots)
        self.roots: tuple[Path, ...] = ()
        for root in roots:
            real = Path(os.path.realpath(root))
            if must_exist and not real.is_dir():
                raise ValueError(f"--lora-root {root!r} is not a folder")
            self.roots += (real,)

    def __bool__(self) -> bool:
        return bool(self.roots)

    def contains(self, path: Path) -> bool:
        """Whether `path`, symlinks resolved, lies inside a root."""
        real = Path(os.path.realpath(path))
        return any(real == root or root in real.parents for root in self.roots)

    def folder(self, path: str) -> Path:
        """The adapter folder `path` names, symlinks resolved and inside a root; raises ValueError
        (outside_message) otherwise, the same for a path outside the roots and one that does not exist."""
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValueError(outside_message(str(path)))
        given = Path(path)
        for candidate in [given] if given.is_absolute() else [root / given for root in self.roots]:
            real = Path(os.path.realpath(candidate))
            if self.contains(real) and real.is_dir():
                return real
        raise ValueError(outside_message(path))

    def lexically_inside(self, path: str) -> bool:
        """Whether `path` stays inside a root by its text alone (no `..` out of it), for a process that may not
        see the adapters' files (the proxy: the engines resolve the path themselves)."""
        if not isinstance(path, str) or not path or "\x00" in path:
            return False
        normal = os.path.normpath(path)
        if not os.path.isabs(normal):
            return normal != ".." and not normal.startswith("../")
        return any(normal == root or normal.startswith(root.rstrip("/") + "/")
                   for root in {*self.named, *map(str, self.roots)})
