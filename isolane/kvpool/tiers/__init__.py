"""The KV pool's tiers behind one interface (``base.Tier``), fastest first: ``memory``
(block bytes under a budget, ``memory_policy`` picks what goes), ``disk`` (the segment
logs of ``isolane.kvpool.log`` on the read group's devices) and ``capacity`` (cold
sealed segments on object storage, filled by ``demotion``).
"""
