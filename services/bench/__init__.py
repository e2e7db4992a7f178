"""`epdserve bench serve`: an OpenAI-API load generator for any endpoint (epdserve's proxy or another server).

options.py builds what a command runs from its flags (ours and `vllm bench serve`'s; vllm_flags.py lists
vLLM's that are refused, and why), datasets.py builds the requests, runner.py sends them (arrival process,
concurrency limit, streaming timestamps), metrics.py turns what the client saw into `vllm bench serve`'s
numbers, result.py into its JSON and file names, plots.py draws them, cli.py wires the command.
"""
