"""The vLLM engine: vLLM's own OpenAI server, in its own Python environment, behind a small adapter that
speaks our engine API (engines/protocol.py, engines/admin.py), so the gateway does not know which
engine it talks to.

    config.py   VllmServerConfig: the adapter's address and tokens, how vLLM is found and started
    process.py  vLLM's server as the adapter's child: command line, environment, start, stop
    server.py   the adapter: completions with our per-token versions, weights, sleep, wake, stats

No module here imports vllm: the adapter runs in our environment and talks to vLLM over HTTP.
"""
