"""isolane inside other frameworks; each module imports its framework only when used.

Training: ``callbacks`` (``PeriodicSnapshot`` for a plain loop; re-exports the HF
Trainer callback and the Lightning CheckpointIO), ``hf_trainer``, ``lightning_io``,
``step_snapshots`` (what the three share: ``<prefix><step>`` snapshots listed, pruned and
saved from rank 0), ``rng`` (RNG states as snapshot values). Inference:
``transformers_kv`` (restore a prompt's cached prefix into a transformers model),
``vllm`` (the vLLM v1 KV connector), ``sglang`` (SGLang HiCache's L3 storage) and
``lmcache`` (an LMCache storage plugin). The core packages never import this one.
"""
