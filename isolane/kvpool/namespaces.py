"""KV namespace names and the folder names they are stored under (pure, no I/O).

ONE rule for every place a namespace enters (``KVPool``, ``open_namespace``,
``drop_namespace``, the ``isolane kv`` commands, a storage node's URLs, the vLLM
connector's ``isolane_namespace``): 1-200 characters of ``[A-Za-z0-9._+=@:/-]``,
starting with a letter or digit, no ``..``, no ``//``, no trailing ``/``. Model names
such as ``meta-llama/Llama-3.1-8B`` fit; ``..``, ``.``, absolute paths, control
characters and a trailing newline do not (matched whole, ``fullmatch``).

On disk a namespace is the folder ``<device>/kvpool/<folder name>``: letters, digits and
``._-`` as they are, every other character as ``%XX`` (its code in upper-case hex), so
``meta-llama/Llama-3.1-8B`` is ``meta-llama%2FLlama-3.1-8B``. A valid namespace never
maps to ``.``, ``..`` or a name with a ``/``; ``namespace_from_folder`` accepts only
the exact folder name ``namespace_folder`` gives, anything else is an
``InvalidNameError`` naming the folder.
"""

from __future__ import annotations

import re

from isolane.errors import InvalidNameError

__all__ = ["check_namespace", "namespace_folder", "namespace_from_folder"]

_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@:/-]{0,199}")
_KEPT = re.compile(r"[A-Za-z0-9._-]")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def check_namespace(name: object) -> str:
    """``name`` when it is a valid KV namespace; InvalidNameError saying what is allowed."""
    if (not isinstance(name, str) or _NAMESPACE.fullmatch(name) is None or ".." in name
            or "//" in name or name.endswith("/")):
        raise InvalidNameError(
            f"invalid KV namespace {name!r:.80}: use 1-200 letters, digits and ._+=@:/- , "
            "starting with a letter or digit, without '..', '//' or a trailing '/' "
            "(e.g. 'meta-llama/Llama-3.1-8B')")
    return name


def namespace_folder(name: str) -> str:
    """The folder name of namespace ``name`` (checked first)."""
    return "".join(ch if _KEPT.fullmatch(ch) else f"%{ord(ch):02X}"
                   for ch in check_namespace(name))


def namespace_from_folder(folder: str, where: str = "") -> str:
    """The namespace stored in the folder called ``folder`` (inside ``where``, for the
    message); InvalidNameError when isolane cannot have written that name."""
    name = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), folder)
    try:
        canonical = namespace_folder(name) == folder
    except InvalidNameError:
        canonical = False
    if canonical:
        return name
    place = f"{where}/{folder}" if where else folder
    raise InvalidNameError(
        f"the folder {place!r} is not a KV namespace folder isolane wrote (its name does "
        "not decode to a valid namespace); move it out of the pool's kvpool folder")
