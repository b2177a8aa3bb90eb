"""The KV pool's tiers: ``memory`` (block bytes under a budget, ``eviction`` policies
pick what goes) and ``capacity`` (cold sealed segments on object storage). The disk tier
is the segment log in ``isolane.kvpool.log``.
"""
