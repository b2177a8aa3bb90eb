"""Clients of storage nodes: the KVPool and SnapshotStore APIs over HTTP.

``kv_pool.RemoteKVPool`` (what ``isolane.open_kv_pool("http://...")`` opens; requests in
``kv_nodes``, streamed answers read by ``batch_stream``), ``snapshot_store.RemoteSnapshotStore``
(what ``isolane.open_store("http://...")`` opens; uploads in ``snapshot_upload``, the staging
of ``save_async`` in ``snapshot_staging``, downloads in ``snapshot_download``), over
``transport`` (pooled urllib3 connections, timeouts, retries). A cluster client adds
``poller`` (load and health probes) and ``mover`` (chain copies on join/leave); where
each chain goes is decided in ``isolane.cluster`` (pure).
"""
