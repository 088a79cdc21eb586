"""CampaignConfig: every layer's typed config in one object, loaded from TOML, usable as flow parameters.

    config = CampaignConfig.from_toml("configs/demo.toml")

Each section goes only to the layer it belongs to: [store] -> storage, [selection] -> the DuckDB
selection views, [packing] -> the processor.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, Field

from tasks.trajectory import PackingConfig, SelectionConfig, StoreConfig


class CampaignConfig(BaseModel):
    name: str = Field("demo", description="a name for the people watching the run")
    trace: str | None = Field(
        None, description="JSONL trace the store demo imports (default: the bundled sample)"
    )
    store: StoreConfig = Field(default_factory=StoreConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    packing: PackingConfig = Field(default_factory=PackingConfig)

    @classmethod
    def from_toml(cls, path: str | Path) -> CampaignConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"campaign config {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"campaign config {path} is not valid TOML: {exc}") from None
        return cls.model_validate(data)
