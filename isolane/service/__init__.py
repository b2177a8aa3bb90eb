"""The storage node (``isolane serve``) and its clients.

Node: ``app`` (aiohttp application, middlewares, graceful shutdown), ``node`` (the
host's SnapshotStore, KV pools and LaneScheduler), ``kv_routes`` and
``snapshot_routes`` (handlers), ``spool`` (uploads), ``auth``, ``metrics``, ``load``.
Wire formats (pure): ``frames`` (KV), ``snapstream`` (snapshots), ``layout``, ``names``,
``statuses``. Clients: ``kv_client.RemoteKVPool`` (also ``KVPool.connect``),
``snapshot_client.RemoteSnapshotStore``, over ``transport`` (urllib3); ``routing``
places chains on nodes. Importing this package imports nothing heavy.
"""
