"""The KV-transfer core: what moves KV blocks and encoder embeddings between engines, whatever the data path -
the server and client (server.py, client.py), the base each data path implements (base.py), the states a
handoff passes through (states.py), and the errors, layouts, runs and checksums both sides share
(transfer.py, checksum.py). The data paths themselves live in transport/zmq_frames/, transport/block_stream/
and transport/ucx/."""

# Whatever moves KV moves tensors in its messages: importing any of the core lets the codec carry them (the
# proxy, which imports none of it, never loads torch).
from epdserve.transport.channel import tensor_frames  # noqa: F401  (registers itself with the codec)
