"""idem-etl: idempotent LLM batch ETL. A redelivered message costs no LLM call and writes no row.

```python
from etl import Pipeline, Classify, Extract, label_in
```
"""

from connectors.sources import DirectorySource, FileSource, JsonlSource, ListSource, Source
from connectors.sources.kafka import KafkaSource
from etl.errors import (
    BadInput,
    BudgetExceeded,
    ConfigError,
    ContextOverflow,
    EtlError,
    LLMError,
    OutputError,
    Refusal,
    SchemaInvalid,
    SemanticInvalid,
    SourceError,
    StoreError,
    TransientLLMError,
    Truncated,
)
from etl.llm import LLM, LLMRequest, LLMResponse, LocalLLM, OpenAICompatibleLLM
from etl.llm.anthropic import AnthropicLLM
from etl.pipeline import Pipeline, load_pipeline
from etl.runtime.decode import Decoder
from etl.runtime.stats import RunStats
from etl.runtime.wiring import run_pipeline
from etl.settings import Settings
from etl.tenancy import Budget, ReviewSampling
from etl.stages import Classify, Extract, Router, Stage, label_in
from etl.validators import Check, date_parses, non_negative, not_empty
from schemas import Classification, Receipt

__all__ = [
    "AnthropicLLM",
    "BadInput",
    "Budget",
    "BudgetExceeded",
    "Check",
    "Classification",
    "Classify",
    "ConfigError",
    "ContextOverflow",
    "Decoder",
    "DirectorySource",
    "EtlError",
    "Extract",
    "FileSource",
    "JsonlSource",
    "KafkaSource",
    "LLM",
    "LLMError",
    "LLMRequest",
    "LLMResponse",
    "ListSource",
    "LocalLLM",
    "OpenAICompatibleLLM",
    "OutputError",
    "Pipeline",
    "Receipt",
    "Refusal",
    "ReviewSampling",
    "Router",
    "RunStats",
    "SchemaInvalid",
    "SemanticInvalid",
    "Settings",
    "Source",
    "SourceError",
    "Stage",
    "StoreError",
    "TransientLLMError",
    "Truncated",
    "date_parses",
    "label_in",
    "load_pipeline",
    "non_negative",
    "not_empty",
    "run_pipeline",
]
