"""idem-etl: idempotent LLM batch ETL. A redelivered message costs no LLM call and writes no row.

```python
from etl import Pipeline, Classify, Extract, label_in
```
"""

from connectors.sources import DirectorySource, JsonlSource, ListSource, Source
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
from etl.pipeline import Pipeline, load_pipeline
from etl.runtime.decode import Decoder
from etl.runtime.stats import RunStats
from etl.runtime.wiring import run_pipeline
from etl.settings import Settings
from etl.stages import Classify, Extract, Stage, label_in
from etl.validators import Check, date_parses, non_negative, not_empty
from schemas import Classification, Receipt

__all__ = [
    "LLM",
    "BadInput",
    "BudgetExceeded",
    "Classification",
    "Classify",
    "ConfigError",
    "ContextOverflow",
    "Decoder",
    "DirectorySource",
    "EtlError",
    "Extract",
    "JsonlSource",
    "KafkaSource",
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
    "Check",
    "date_parses",
    "label_in",
    "non_negative",
    "not_empty",
    "load_pipeline",
    "run_pipeline",
]
