"""The channel layer: typed messages (protocol.py) and the only code that turns them into bytes (codec.py;
tensors, which need torch, in tensor_frames.py), the typed request/reply and push channels over ZMQ
(common.py, reply_server.py, request_client.py), who may connect (peer_auth.py, security.py), size limits
(limits.py) and a pool of connections to peers (peer_pool.py). Nothing here imports the KV-transfer core."""
