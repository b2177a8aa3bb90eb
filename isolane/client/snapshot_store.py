"""RemoteSnapshotStore: the SnapshotStore API against a storage node or a cluster.

``isolane.open_store("http://host:port")`` returns one (and a ``SnapshotStore`` for a
folder or config), so a training loop switches between a local store and a node by the
target alone; ``RemoteSnapshotStore([url, ...])`` spreads snapshots over several nodes.

Cluster rule: a snapshot lives whole on one node, the owner of its name on the
consistent-hash ring of the nodes (``HashRing.owner(utf8(name))``, the KV ring's layout),
or the next node along the ring when the owner cannot be reached. Snapshots are not
moved when nodes join or leave (a checkpoint is large and read rarely): reads try the
owner, then every other node in ring order, so a snapshot saved before a join is found
where it was saved. ``list`` merges every node's list; a save without ``overwrite``
refuses a name stored on any node, one with ``overwrite`` removes the other copies.

``save`` streams the state dict (tensors as dtype/shape plus raw bytes, the rest as the
manifest's JSON tree; ``wire/snapshot_stream.py``) and returns once the node has committed it;
``load`` streams it back, writing each tensor's bytes straight into its destination
(``into=`` tensors where they match).
Errors are the embedded store's (``SnapshotNotFoundError``, ``SnapshotExistsError``,
``IntegrityError`` ...); a node that cannot be reached is a ``NodeUnavailableError``.

Thread-safe (one transport; each call is one request per node tried).
"""

from __future__ import annotations

import builtins
import json
import logging
import math
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import torch

from isolane.client import snapshot_parts
from isolane.client.snapshot_download import (
    DOWNLOAD_PARTS,
    Download,
    receive_chunks,
    receive_parts,
    served_parts,
)
from isolane.client.snapshot_staging import ClientStaging
from isolane.client.snapshot_upload import read_info, upload
from isolane.client.transport import ClientOptions, Transport, check_node_url, finish
from isolane.cluster.ring import HashRing
from isolane.errors import (
    ConflictError,
    InvalidArgumentError,
    NodeUnavailableError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from isolane.snapshot.manifest import ChunkRecord, Manifest
from isolane.snapshot.names import (
    ChangeDetection,
    check_change_detection,
    check_metadata,
    check_snapshot_name,
)
from isolane.snapshot.results import AsyncSaves, GcReport, SaveHandle, SnapshotInfo
from isolane.snapshot.retention import plan_retention
from isolane.snapshot.tree import dotted_key, flatten_state, key_filter, unflatten_state
from isolane.snapshot.versions import TensorVersions
from isolane.wire import snapshot_stream as ss
from isolane.wire.auth import resolve_token

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
T = TypeVar("T")
RELOAD_ATTEMPTS = 3  # downloads restarted when an overwrite replaced the generation
COPY_THREADS = 2  # save_async staging copies run on this many threads
COPY_PIECE_BYTES = 8 << 20  # in pieces of this size (smaller tensors: copy_)


class RemoteSnapshotStore:
    """Snapshots on the node at ``url``, or on the nodes of a list of URLs (module
    docstring). ``timeout_s`` bounds each wait for bytes (a save's commit included: the
    node answers once the manifest is written)."""

    def __init__(self, url: str | Sequence[str], *, token: str | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0, retries: int = 2,
                 backoff_s: float = 0.2) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise InvalidArgumentError("a RemoteSnapshotStore needs at least one node URL")
        self._nodes = tuple(check_node_url(u) for u in urls)
        self._ring = HashRing(self._nodes)  # refuses a node listed twice
        self._url = self._nodes[0]
        self._transport = Transport(ClientOptions(
            token=resolve_token(token), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s))
        self._staging = ClientStaging()
        self._async_saves = AsyncSaves()
        self._async_thread: threading.Thread | None = None
        self._mirror_urls: dict[str, str | None] = {}
        self._versions = TensorVersions()  # chunk hashes of tensors as last uploaded
        self._client_id = secrets.token_hex(16)  # a node binds the plans it keeps to it

    @property
    def url(self) -> str:
        """The first node's URL (the only one of a single-node store)."""
        return self._url

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def home(self, name: str) -> builtins.list[str]:
        """The nodes for snapshot ``name`` in the order they are tried: its owner on the
        ring first."""
        return list(self._ring.walk(name.encode()))

    def _first(self, name: str, call: Callable[[str], T]) -> T:
        """``call(node)`` on the first node (in ``home`` order) that holds ``name``."""
        unavailable: NodeUnavailableError | None = None
        missing: SnapshotNotFoundError | None = None
        for node in self.home(name):
            try:
                return call(node)
            except SnapshotNotFoundError as exc:
                missing = exc
            except NodeUnavailableError as exc:
                unavailable = exc
        if unavailable is not None:  # it may be on the node that did not answer
            raise unavailable
        if len(self._nodes) == 1 and missing is not None:
            raise missing
        raise SnapshotNotFoundError(name, f"the cluster {list(self._nodes)}")

    # -- saving ------------------------------------------------------------------------------
    def save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None, *,
             overwrite: bool = False, mirror: bool | None = None,
             progress: Progress | None = None,
             change_detection: ChangeDetection = "hash") -> SnapshotInfo:
        """Upload and return once a node has committed the snapshot: the name's owner,
        or the next node that answers. Chunks the node already holds (its parent
        snapshot's) are sent as hashes and linked there. A save that breaks off (client,
        network or node) commits nothing; saving again is safe. ``mirror``: copy it to
        the node's capacity group afterwards (default: the node's config).
        ``change_detection="version"``: tensors untouched (by torch's version counter)
        since this client saved the node's parent snapshot are linked without hashing
        them again (as ``SnapshotStore.save``; see ``isolane.snapshot.versions``)."""
        check_snapshot_name(name)
        check_change_detection(change_detection)
        self._async_saves.raise_unreported_error()
        return self._save(state_dict, name, metadata, overwrite, mirror, progress,
                          change_detection)

    def _save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None,
              overwrite: bool, mirror: bool | None, progress: Progress | None,
              change_detection: ChangeDetection = "hash") -> SnapshotInfo:
        if len(self._nodes) == 1:
            return self._save_on(self._url, state_dict, name, metadata, overwrite, mirror,
                                 progress, change_detection)
        holders = self._holders(name)
        if holders and not overwrite:
            raise SnapshotExistsError(name, holders[0])
        failure: NodeUnavailableError | None = None
        for node in self.home(name):
            try:
                info = self._save_on(node, state_dict, name, metadata, overwrite, mirror,
                                     progress, change_detection)
            except NodeUnavailableError as exc:
                failure = exc
                log.warning("snapshot '%s' not saved on %s, trying the next node: %s",
                            name, node, exc)
                continue
            for other in holders:  # the copies an overwrite replaces
                if other != node:
                    self._delete_on(other, name)
            return info
        assert failure is not None  # the loop ran at least once
        raise failure

    def save_async(self, state_dict: Any, name: str,
                   metadata: Mapping[str, Any] | None = None, *, overwrite: bool = False,
                   mirror: bool | None = None, progress: Progress | None = None
                   ) -> SaveHandle:
        """Copy every tensor into staging memory on this client and return (the caller
        may then change its tensors); the upload runs in the background. ``result()``
        on the handle waits for the commit and raises the save's error; an error nobody
        asked for is raised by the next save. One async save at a time: the next one
        waits for this one (and reuses its staging memory)."""
        check_snapshot_name(name)
        check_metadata(metadata)
        self.wait()
        self._async_saves.raise_unreported_error()
        staged = self._staging.stage(state_dict)
        future: Future[SnapshotInfo] = Future()
        handle = SaveHandle(name, future)

        def upload() -> None:
            try:
                info = self._save(staged, name, metadata, overwrite, mirror, progress)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(info)

        self._async_saves.started(handle)
        thread = threading.Thread(target=upload, name=f"isolane-upload-{name}", daemon=True)
        self._async_thread = thread
        thread.start()
        return handle

    def wait(self) -> None:
        """Wait for an async save in flight (its errors stay on its handle)."""
        thread = self._async_thread
        if thread is not None:
            thread.join()

    def _holders(self, name: str) -> builtins.list[str]:
        """Nodes that answer that they hold ``name`` (nodes that do not answer skipped)."""
        out = []
        for node in self.home(name):
            try:
                self._info_on(node, name)
            except (SnapshotNotFoundError, NodeUnavailableError):
                continue
            out.append(node)
        return out

    def _save_on(self, node: str, state_dict: Any, name: str,
                 metadata: Mapping[str, Any] | None, overwrite: bool, mirror: bool | None,
                 progress: Progress | None, change_detection: ChangeDetection = "hash"
                 ) -> SnapshotInfo:
        return upload(self._transport, self._versions, node, state_dict, name, metadata,
                      overwrite=overwrite, mirror=mirror, progress=progress,
                      change_detection=change_detection, client_id=self._client_id)

    # -- a multi-rank save, part by part (isolane.client.snapshot_parts) --------------------
    def begin_parts(self, name: str, *, overwrite: bool = False,
                    parent: str | bool | None = None) -> tuple[str, builtins.list[str] | None]:
        """Begin a save whose ranks each send a part (on the node that owns ``name``):
        its generation and parent, for ``save_part`` and ``commit_parts``."""
        check_snapshot_name(name)
        return snapshot_parts.begin(self._transport, self.home(name)[0], name,
                                    overwrite=overwrite, parent=parent)

    def save_part(self, name: str, generation: str, parent: builtins.list[str] | None,
                  rank: int, items: Mapping[str, torch.Tensor], *,
                  overwrite: bool = False) -> str:
        """Rank ``rank``'s tensors as its part of the begun save; the part's manifest."""
        return snapshot_parts.save_part(self._transport, self.home(name)[0], name,
                                        generation, parent, rank, items,
                                        overwrite=overwrite, client_id=self._client_id)

    def commit_parts(self, name: str, generation: str, parent: builtins.list[str] | None,
                     world: int, dcp: dict[str, Any], metadata: dict[str, Any], *,
                     overwrite: bool = False, mirror: bool | None = None,
                     seconds: float = 0.0) -> SnapshotInfo:
        """Commit the save once each of the ``world`` ranks has its part on the node."""
        return snapshot_parts.commit(self._transport, self.home(name)[0], name, generation,
                                     parent, world, dcp, metadata, overwrite=overwrite,
                                     mirror=mirror, seconds=seconds)

    # -- reading -----------------------------------------------------------------------------
    def load(self, name: str, map_location: str | torch.device = "cpu",
             keys: builtins.list[str] | None = None, progress: Progress | None = None, *,
             into: Any = None) -> Any:
        """The state dict as saved (or the subtrees under ``keys``). ``into``: tensors
        filled in place where key, dtype and shape match (as ``SnapshotStore.load``).
        Every chunk is checked against the manifest's hash as it arrives
        (IntegrityError naming the tensor)."""
        check_snapshot_name(name)
        targets = _targets(into)

        def load_from(node: str) -> tuple[ss.StreamHeader, dict[int, torch.Tensor]]:
            for attempt in range(RELOAD_ATTEMPTS):
                try:
                    return self._download(node, name, keys, targets, progress)
                except ConflictError:
                    if attempt == RELOAD_ATTEMPTS - 1:
                        raise
                    log.info("snapshot '%s' was overwritten on %s while it downloaded; "
                             "loading the live one", name, node)
            raise AssertionError("unreachable")

        header, tensors = self._first(name, load_from)
        if str(map_location) != "cpu":
            tensors = {tid: t if any(t is v for v in targets.values()) else t.to(map_location)
                       for tid, t in tensors.items()}
        wanted = key_filter(keys)
        return unflatten_state(header.tree, tensors.__getitem__, wanted)

    def _download(self, node: str, name: str, keys: builtins.list[str] | None,
                  targets: Mapping[str, torch.Tensor], progress: Progress | None
                  ) -> tuple[ss.StreamHeader, dict[int, torch.Tensor]]:
        """One download of ``name`` from ``node``, over ``DOWNLOAD_PARTS`` connections
        when the node splits it (``snapshot_download``)."""
        asked = DOWNLOAD_PARTS

        def open_part(part: int, parts: int, generation: str | None) -> Any:
            query: builtins.list[tuple[str, str]] = [("keys", k) for k in keys or ()]
            query += [("part", str(part)), ("parts", str(parts))]
            if generation is not None:
                query.append(("generation", generation))
            return self._transport.request(
                "GET", node, f"/v1/snapshots/{quote(name)}/data?{urlencode(query)}",
                idempotent=True, stream=True)

        first = open_part(0, asked, None)
        complete = False
        try:
            parts, generation = served_parts(first, asked, node)
            download = Download(targets, progress, node)
            header = download.open(first)
            tensors = receive_parts(first, open_part, download, parts, generation)
            complete = True
        finally:
            finish(first, complete=complete)
        return header, tensors

    def read_chunks(self, name: str, generation: str, records: Sequence[ChunkRecord],
                    on_chunk: Callable[[ChunkRecord, memoryview], None]) -> int:
        """Chunk files of generation ``generation`` of ``name`` (as ``manifest`` lists
        them), whole and in order; ``on_chunk(record, data)`` gets each once its hash
        matched the record's. ConflictError when another generation is live now. The
        bytes received."""
        check_snapshot_name(name)
        if not records:
            return 0
        body = {"generation": generation, "chunks": [r.key for r in records]}

        def read_from(node: str) -> int:
            response = self._transport.request(
                "POST", node, f"/v1/snapshots/{quote(name)}/chunks",
                body=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                idempotent=True, stream=True)
            complete = False
            try:
                total = receive_chunks(response, records, node, on_chunk)
                complete = True
            finally:
                finish(response, complete=complete)
            return total
        return self._first(name, read_from)

    def info(self, name: str) -> SnapshotInfo:
        check_snapshot_name(name)
        return self._first(name, lambda node: self._info_on(node, name))

    def _info_on(self, node: str, name: str) -> SnapshotInfo:
        return read_info(self._transport.json("GET", node, f"/v1/snapshots/{quote(name)}",
                                          idempotent=True))

    def manifest(self, name: str) -> Manifest:
        """The snapshot's committed manifest (tensors, chunks, stats) as the node has it."""
        check_snapshot_name(name)
        return self._first(name, lambda node: self._manifest_on(node, name)[0])

    def path(self, name: str) -> str:
        """Where the snapshot lies: the node's URL and the folder there."""
        check_snapshot_name(name)
        return self._first(name, lambda node: f"{node} {self._manifest_on(node, name)[1]}")

    def _manifest_on(self, node: str, name: str) -> tuple[Manifest, str]:
        response = self._transport.request("GET", node, f"/v1/snapshots/{quote(name)}/manifest",
                                           idempotent=True)
        where = f"{node}/v1/snapshots/{name}/manifest"
        return (Manifest.from_json(response.data, where),
                response.headers.get(ss.PATH_HEADER, where))

    def list(self) -> builtins.list[SnapshotInfo]:
        """Committed snapshots, oldest first: every node's, merged (a name on two nodes
        once, the newer). Nodes that do not answer are skipped (logged) unless none does."""
        found: dict[str, SnapshotInfo] = {}
        for _node, answer in self._each("GET", "/v1/snapshots"):
            for item in answer["snapshots"]:
                info = read_info(item)
                known = found.get(info.name)
                if known is None or info.committed_at > known.committed_at:
                    found[info.name] = info
        return sorted(found.values(), key=lambda i: (i.committed_at, i.name))

    def _each(self, method: str, path: str) -> Iterator[tuple[str, Any]]:
        """``(node, JSON answer)`` of every node that answers; NodeUnavailableError only
        when none does (a single node's error as is)."""
        failure: NodeUnavailableError | None = None
        answered = False
        for node in self._nodes:
            try:
                answer = self._transport.json(method, node, path, idempotent=True)
            except NodeUnavailableError as exc:
                if len(self._nodes) == 1:
                    raise
                failure = exc
                log.warning("%s %s skipped on %s: %s", method, path, node, exc)
                continue
            answered = True
            yield node, answer
        if not answered and failure is not None:
            raise failure

    def verify(self, name: str, progress: Progress | None = None) -> SnapshotInfo:
        """The node reads back every chunk and checks it; raises IntegrityError.
        (``progress`` is accepted for the embedded API's sake; it is called once.)"""
        check_snapshot_name(name)
        info = self._first(name, lambda node: read_info(self._transport.json(
            "POST", node, f"/v1/snapshots/{quote(name)}/verify", idempotent=True)))
        if progress is not None:
            progress(info.stored_bytes, info.stored_bytes)
        return info

    def delete(self, name: str) -> None:
        """Delete ``name`` from every node that holds it; SnapshotNotFoundError if none
        does."""
        check_snapshot_name(name)
        if len(self._nodes) == 1:
            self._delete_on(self._url, name)
            return
        holders = self._holders(name)
        if not holders:
            self._first(name, lambda node: self._info_on(node, name))  # raises the reason
        for node in holders:
            self._delete_on(node, name)

    def _delete_on(self, node: str, name: str) -> None:
        self._transport.json("DELETE", node, f"/v1/snapshots/{quote(name)}",
                             idempotent=True)

    # -- retention and mirrors ---------------------------------------------------------------
    def gc(self, keep_last: int | None = None) -> GcReport:
        """Keep the ``keep_last`` newest snapshots (across every node; default: each
        node's config) and sweep what failed or killed saves left on each node."""
        deleted: builtins.list[str] = []
        if keep_last is not None and len(self._nodes) > 1:
            committed = [(i.name, i.committed_at) for i in self.list()]
            for name in plan_retention(committed, keep_last):
                self.delete(name)
                deleted.append(name)
        query = f"?keep_last={keep_last}" if keep_last is not None and len(
            self._nodes) == 1 else ""
        swept: builtins.list[str] = []
        for node, answer in self._each("POST", f"/v1/snapshots/_gc{query}"):
            deleted += answer["deleted_snapshots"]
            where = "" if len(self._nodes) == 1 else f"{node} "
            swept += [where + g for g in answer["swept_generations"]]
        return GcReport(tuple(deleted), tuple(swept))

    def sync_mirrors(self) -> builtins.list[str]:
        """Start mirroring, on every node, each committed snapshot its capacity group
        lacks; returns their names. A node without a capacity group is an error."""
        started: builtins.list[str] = []
        for node, answer in self._each("POST", "/v1/snapshots/_mirror"):
            self._mirror_urls[node] = answer.get("mirror")
            started += answer["started"]
        return started

    def wait_for_mirrors(self, timeout: float | None = None) -> dict[str, str | None]:
        """Wait for the nodes' mirrors in flight; name -> None or the error text."""
        query = f"?timeout_s={max(1, math.ceil(timeout))}" if timeout is not None else ""
        out: dict[str, str | None] = {}
        for node, answer in self._each("POST", f"/v1/snapshots/_mirror/wait{query}"):
            self._mirror_urls[node] = answer.get("mirror")
            out.update(answer["results"])
        return out

    def mirror_urls(self) -> dict[str, str | None]:
        """Each node's capacity group (as its last mirror answer named it)."""
        return dict(self._mirror_urls)

    def close(self) -> None:
        """Wait for an async save in flight, then drop connections and staging memory."""
        self.wait()
        self._staging.clear()
        self._transport.close()

    def __enter__(self) -> RemoteSnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = self._url if len(self._nodes) == 1 else list(self._nodes)
        return f"RemoteSnapshotStore({shown!r})"


def _targets(into: Any) -> dict[str, torch.Tensor]:
    if into is None:
        return {}
    _tree, leaves = flatten_state(into)
    return {dotted_key(leaf.path): leaf.tensor for leaf in leaves}
