"""SGLang HiCache's L3 storage backend on the KV pool: ``IsolaneHiCacheStorage``
(imports SGLang; ``storage.py``). ``pages`` holds what a page is to the pool (format,
scope, keys) without SGLang. SGLang's ``dynamic`` backend names
``module_path: isolane.integrations.sglang``, ``class_name: IsolaneHiCacheStorage``."""

from isolane.integrations.sglang.storage import IsolaneHiCacheStorage

__all__ = ["IsolaneHiCacheStorage"]
