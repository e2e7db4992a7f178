"""The ZMQ-frames data path: KV blocks and embeddings as zero-copy frames on the KV transfer server's control
channel (path.py)."""
