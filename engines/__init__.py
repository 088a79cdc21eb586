"""Engines: the parts that hold a model or its tokens (DESIGN.md section 3).

    model/      policy model + tokenizer + chat template, HF format; weights.py, the weight files
    rollout/    inference engine: continuous batching, prefix KV cache, weight hot-swap, KV export/import
    gateway/    OpenAI-compatible proxy: token-exact recording, session affinity, rerouting with KV migration
    train/      tree-packed loss, trainer backends, elastic data parallel
    protocol.py the engine wire (gateway <-> engine server), imported by both sides
    admin.py    the admin wire of the engines and of the gateway's engine management: every /admin/
                path, the typed request and response models, AdminClient (what every caller uses)
    options.py  command-line options generated from the config classes (engines' servers and `gyre`)
    net.py      free_port;  quantiles.py  quantile (the one definition of each, for every layer above)

Engines never import flows/, tasks/, scheduler/, sim/ or environments/; flows reach them through tasks/.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` that imports each exported name from its module (``homes``:
    name -> module under the package) on first use, so reading one config class of a package does not
    import its torch or web stack."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return __getattr__
