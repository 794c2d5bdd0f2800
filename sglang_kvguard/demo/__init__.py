"""Demo and test helpers: a tiny local model and a real loopback PD deployment.

Nothing here is imported by the guard itself; heavy imports (transformers,
tokenizers, requests) happen lazily inside functions so that ``import
sglang_kvguard`` keeps working without them.
"""
