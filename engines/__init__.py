"""Engines: the parts that hold a model or its tokens (DESIGN.md section 3).

    model/     policy model + tokenizer + chat template, HF format
    rollout/   inference engine (later issues)
    gateway/   OpenAI-compatible proxy (later issues)
    train/     tree-packed loss and trainer backends (later issues)

Engines never import flows/, tasks/, scheduler/, sim/ or environments/; flows reach them through tasks/.
"""
