"""Server settings: one pydantic-settings object, read from `ZAYA_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZAYA_", extra="ignore")

    data_dir: Path = Path("./var")
    # Empty means the embedded default: an SQLite file under `data_dir`.
    database_url: str = ""
    engine: Literal["vllm", "local"] = "local"

    host: str = "127.0.0.1"
    port: int = 8000

    # Uploads are streamed to disk; anything larger is refused with 413.
    max_upload_bytes: int = Field(default=1024**3, gt=0)
    # Limit for every other request body (JSON).
    max_request_bytes: int = Field(default=8 * 1024**2, gt=0)

    # `last_used_at` is written at most this often per key, so authentication stays a read on the hot path.
    key_last_used_resolution_s: float = Field(default=60.0, ge=0)

    @model_validator(mode="after")
    def _default_database_url(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'zaya.db').resolve()}"
        return self

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"
