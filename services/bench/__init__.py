"""`epdserve bench serve`: an OpenAI-API load generator for any endpoint (epdserve's proxy or another server).

datasets.py builds the requests, runner.py sends them (arrival process, concurrency limit, streaming
timestamps), metrics.py turns what the client saw into `vllm bench serve`-shaped numbers, plots.py draws
them, cli.py wires the command.
"""
