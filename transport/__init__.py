"""How services talk and move KV, in three layers, each importing only those below it (pyproject.toml's
import-linter contracts hold them so):

- `channel/`: the typed messages and their codec, the request/reply and push channels over ZMQ, peer
  authentication, CURVE and bind policy, size limits. What every service uses; the proxy loads nothing else
  of transport, and no torch.
- `kv/`: the KV-transfer core - the transfer server and client, the base every data path implements, the
  errors, layouts, checksums and named states of a handoff.
- one package per data path over that core, none importing another: `zmq_frames/` (blocks and embeddings as
  ZMQ frames), `block_stream/` (blocks over plain TCP connections), `ucx/` (UCX tagged messages);
  `transports.py` assembles them into the `--kv-transport` choices.
"""
