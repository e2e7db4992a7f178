"""The engine core every service runs: requests, the scheduler over a paged KV block manager, the model
runner and sampler, and the two front doors (`LLM` offline, `AsyncLLM` for a service's event loop).

`wire.py` is the engine's edge: the one place its types become the wire's (`epdserve.transport.protocol`).
"""
