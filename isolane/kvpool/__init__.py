"""KV pool: prefix-keyed KV block store (read lane)."""
