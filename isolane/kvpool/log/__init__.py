"""The KV segment log: the pool's disk tier, Bitcask style.

``records`` and ``framing`` (the pure byte format of records and batches), ``segment_log``
(``SegmentLog``: append, seal, locate, read, reopen, compact), its parts
``segment_files``, ``segment_reads`` (the read path), ``segment_writes`` (the write path),
``segment_reopen``, ``segment_scan``, ``segment_compaction``, the key
directory (``keydir``, ``keytable``), pure decisions (``compaction``, ``coalesce``) and
coalesced reads into the caller's memory (``reader``).
"""
