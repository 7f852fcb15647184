"""Server settings: one pydantic-settings object, read from `ZAYA_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZAYA_", extra="ignore")

    data_dir: Path = Path("./var")
    # Empty means the embedded default: an SQLite file under `data_dir`.
    database_url: str = ""
    # Connections kept open for the reads every request makes (authentication, model resolution), as many again
    # under load. Fewer than the requests authenticating at once makes the pool open and close connections.
    database_pool_size: int = Field(default=20, ge=1)
    engine: Literal["vllm", "local"] = "local"

    host: str = "127.0.0.1"
    port: int = 8000

    # Uploads are streamed to disk; anything larger is refused with 413.
    max_upload_bytes: int = Field(default=1024**3, gt=0)
    # PII scan of uploads (`finetune.datasets.pii`): "report" notes the findings in the file's `status_details`,
    # "reject" refuses a file with any finding (400 `pii_detected`), "off" skips the scan.
    upload_pii_scan: Literal["off", "report", "reject"] = "off"
    # Limit for every other request body (JSON).
    max_request_bytes: int = Field(default=8 * 1024**2, gt=0)

    # Per-key rate limits (0 turns one off), counted over fixed windows of `rate_limit_window_s` (a minute).
    # Tokens are a request's prompt plus its max_tokens (times n), charged when it is admitted.
    rate_limit_requests_per_minute: int = Field(default=600, ge=0)
    rate_limit_tokens_per_minute: int = Field(default=1_000_000, ge=0)
    rate_limit_window_s: int = Field(default=60, ge=1)
    # Where the counters live (a `limits` storage URI). "memory://" keeps them per API process; with several
    # processes use a shared store (e.g. "redis://host:6379", needs the `redis` package) so the limits hold overall.
    rate_limit_storage_uri: str = "memory://"

    # `last_used_at` is written at most this often per key, so authentication stays a read on the hot path.
    key_last_used_resolution_s: float = Field(default=60.0, ge=0)

    # Web console sessions (`/console`): an encrypted cookie that ends after this long without a user action.
    console_idle_timeout_s: float = Field(default=1800.0, gt=0)
    # Key for the session cookies; empty means a random one per server process (sessions end on restart). Set it
    # when several server processes share the traffic or sessions should survive a restart.
    console_secret: SecretStr = SecretStr("")

    # Governance of alias moves: a second admin key approves each promotion/rollback (four-eyes), and a promotion
    # whose held-out loss is worse than the current holder's is refused (evaluation gate).
    four_eyes: bool = False
    evaluation_gate: bool = True

    @model_validator(mode="after")
    def _default_database_url(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'zaya.db').resolve()}"
        return self

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"
