"""The storage node (``isolane serve``) and its clients.

Node: ``app`` (aiohttp application, middlewares, graceful shutdown), ``node`` (the
host's SnapshotStore, KV pools and LaneScheduler), ``kv_routes`` and
``snapshot_routes`` (handlers; uploads stream into the store's writer), ``chains``
(which chains the node holds), ``auth``, ``metrics``, ``load``. Wire formats (pure):
``frames`` (KV), ``snapstream`` (snapshots), ``layout``, ``names``, ``statuses``. Clients:
``kv_client.RemoteKVPool`` (also ``KVPool.connect``; its requests in ``kv_nodes``,
``batch_stream`` reads their answers) and ``snapshot_client.RemoteSnapshotStore``, over
``transport`` (urllib3). A cluster: ``cluster.ClusterRouter`` (pure: where each chain
goes), ``poller`` (load and health probes), ``mover`` (moves on join/leave);
``routing`` is the router protocol. Importing this package imports nothing
heavy.
"""
