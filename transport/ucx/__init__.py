"""The UCX data path: KV blocks and embeddings as UCX tagged messages (path.py), over this process's UCX
endpoints (endpoints.py). Needs the `ucx` extra (ucxx), imported on first use."""
