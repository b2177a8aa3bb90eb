"""Where KV chains live across storage nodes (pure: no I/O, no clock, no threads).

``chain_segments`` (the unit of placement: a chain cut into segments), ``ring``
(consistent-hash rings over nodes and devices), ``membership`` (the node list, health,
moves on join/leave), ``routing`` (the router protocol) and ``router.ClusterRouter``
(where a RemoteKVPool sends each segment). The clients in ``isolane.client`` do the I/O.
"""
