"""One exception hierarchy for isolane.

Every message names the thing that went wrong and the way out. Children also inherit
the builtin that callers already catch (``FileNotFoundError``, ``ValueError`` ...), so
``except FileNotFoundError`` keeps working around isolane calls.
"""

from __future__ import annotations


class IsolaneError(Exception):
    """Root of every error isolane raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        """Pickles whatever a subclass's ``__init__`` takes (torch.distributed sends a
        rank's exception to the other ranks pickled): rebuilt without calling it."""
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[IsolaneError], args: tuple[object, ...], state: dict[str, object]
             ) -> IsolaneError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(IsolaneError, ValueError):
    """A config file or argument is invalid; ``field`` names the offending setting."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"config field '{field}': {problem}")


class InvalidNameError(IsolaneError, ValueError):
    """A snapshot name, key or path component is not allowed."""


class UnsupportedValueError(IsolaneError, TypeError):
    """A state-dict leaf cannot be stored; ``key`` is its path in the state dict."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"state_dict{key}: {problem}")


class SnapshotNotFoundError(IsolaneError, FileNotFoundError):
    def __init__(self, name: str, where: str) -> None:
        self.name = name
        self.where = where
        super().__init__(
            f"snapshot '{name}' not found in {where}; run 'isolane ls' to list snapshots"
        )


class SnapshotExistsError(IsolaneError, FileExistsError):
    def __init__(self, name: str, where: str) -> None:
        self.name = name
        super().__init__(
            f"snapshot '{name}' already exists in {where}; pass overwrite=True "
            "(CLI: --overwrite) to replace it, or choose another name"
        )


class IntegrityError(IsolaneError):
    """Stored bytes do not match their checksum; ``what`` names the tensor or record."""

    SNAPSHOT_HINT = "restore from the mirror or an older snapshot ('isolane ls')"

    def __init__(self, what: str, detail: str, hint: str = SNAPSHOT_HINT) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"integrity check failed for {what}: {detail}; the stored copy "
                         f"is damaged — {hint}")


class CapacityError(IsolaneError, OSError):
    """A device ran out of space (or the staging budget cannot hold one chunk)."""


class StorageError(IsolaneError, OSError):
    """A storage backend failed (unreachable server, permission, I/O error)."""


class MissingDependencyError(IsolaneError, ImportError):
    def __init__(self, package: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs the package '{package}'; run: pip install {package}")


class KeyNotFoundError(IsolaneError, KeyError):
    """A requested key is not in the snapshot or pool."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(IsolaneError, ValueError):
    """An argument has the wrong type or value; the message names it."""


class DistributedSaveError(IsolaneError):
    """A multi-rank save did not commit: a rank failed or died; nothing was committed."""


class ConflictError(IsolaneError, ValueError):
    """The request contradicts what is stored (e.g. another layout for a KV namespace)."""


class WireFormatError(InvalidArgumentError):
    """A framed body does not follow docs/FORMATS.md (magic, lengths, checksums)."""


class PayloadTooLargeError(InvalidArgumentError):
    """A request body, a frame or a count is over a storage node's limit (``limit``)."""

    def __init__(self, what: str, size: int, limit: int, unit: str = "bytes",
                 field: str | None = None) -> None:
        self.limit = limit
        self.field = field
        raise_it = (f"raise {field} in the node's config" if field is not None
                    else "raise the limit ('isolane serve --help')")
        super().__init__(f"{what} is {size} {unit}, over this node's limit of {limit} "
                         f"{unit}; send smaller batches or {raise_it}")


class AuthenticationError(IsolaneError, PermissionError):
    """A storage node refused the request: its bearer token is missing or wrong."""


class EtcdUnavailableError(IsolaneError, ConnectionError):
    """The etcd server that keeps the cluster's membership did not answer; ``url`` names
    it (``etcd://host:port/prefix``)."""

    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        super().__init__(f"etcd {url} is unavailable ({detail}); check that etcd runs there "
                         "and the URL (cluster.etcd.url or --cluster) is right")


class NodeUnavailableError(StorageError):
    """A storage node could not be reached, or broke off mid-response; ``url`` names it."""

    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        super().__init__(f"storage node {url} is unavailable ({detail}); check that "
                         f"'isolane serve' runs there and the URL is right")
