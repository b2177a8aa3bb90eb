"""The vLLM v1 KV connector: ``connector.IsolaneConnectorV1`` (imports vLLM).

``pool_connector`` holds its logic without vLLM (scheduler side: what to load and save;
worker side: copies between paged buffers and the pool), ``paged`` the paged-buffer
copies (pure), ``transfers`` the background thread of async loads and saves. vLLM
configs name ``isolane.integrations.vllm.connector``; the old path
``isolane.kvpool.vllm_connector`` still works (a re-export).
"""
