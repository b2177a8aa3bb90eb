"""The storage node behind ``isolane serve``: the aiohttp app and its routes.

``app`` (application, middlewares, graceful shutdown, ``run_node``), ``resources`` (the
host's LaneScheduler, SnapshotStore and KV pools, opened once per node), ``kv_routes``
and ``snapshot_routes`` (handlers; ``snapshot_upload`` streams an upload into the
store's save driver, ``snapshot_download`` streams chunk files back),
``namespaces`` (one KVPool per namespace), ``chains`` (which chains the node holds),
``bodies`` (request bodies under limits), ``load`` and ``metrics``. Wire formats are in
``isolane.wire``; importing this package imports nothing heavy.
"""
