"""The block-stream data path: KV blocks over plain TCP connections, straight from the server's cache into the
client's - the connections' protocol (stream.py) and its plug into a KV transfer server and client (path.py)."""
