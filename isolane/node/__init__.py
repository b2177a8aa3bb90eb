"""The storage node behind ``isolane serve``: the aiohttp app and its routes.

``app`` (application, middlewares, graceful shutdown, ``run_node``), ``resources`` (the
host's LaneScheduler, SnapshotStore and KV pools, opened once per node), ``kv_routes``
and ``snapshot_routes`` (handlers; uploads stream into the store's writer),
``namespaces`` (one KVPool per namespace), ``chains`` (which chains the node holds),
``bodies`` (request bodies under limits), ``load`` and ``metrics``. Wire formats are in
``isolane.wire``; importing this package imports nothing heavy.
"""
