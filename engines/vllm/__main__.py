"""python -m engines.vllm: one vLLM engine (engines/vllm/server.py)."""

from engines.vllm.server import main

main()
