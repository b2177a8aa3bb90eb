"""The KV segment log: the pool's disk tier, Bitcask style.

``records`` and ``framing`` (the pure byte format of records and batches), ``segment_log``
(``SegmentLog``, one class: reopen, locate, read, append, seal, compact, evict), the
segment files and their I/O (``segment_files``), the recovery scan (``segment_scan``), the
hint files (``hint_columns``, ``hint_reads``, ``bulk_load``), the key
directory (``keydir``, ``keytable``), pure decisions (``compaction``, ``coalesce``) and
coalesced reads into the caller's memory (``reader``).
"""
