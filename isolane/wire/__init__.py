"""What goes over the wire between nodes and clients (pure: no I/O).

``frames`` (KV key lists and framed block batches), ``snapshot_stream`` (a save's upload
and a restore's download), ``layout`` (a KV namespace's layout), ``names`` (valid
keys, namespaces and snapshot names), ``statuses`` (errors <-> HTTP statuses), ``auth``
(bearer tokens). Both sides import these; neither side's code lives here.
"""
