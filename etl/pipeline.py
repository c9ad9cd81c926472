"""Declaring a pipeline, and loading one from ``path/to/file.py`` or ``module:attr``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from connectors.sources import Source, source_for_path
from connectors.store.tables import same_columns
from etl.runtime.decode import Decoder
from etl.errors import ConfigError
from etl.llm.base import LLM
from etl.stages import Classify, Extract, LabelIn, Stage
from etl.tenancy import Budget, ReviewSampling


class Pipeline:
    """A source, stages in order, where results go, and which model answers.

    Args:
        name: Identifies the pipeline's rows and positions in the store; keep it stable.
        source: A Source, or a path (a ``.jsonl`` file or a directory of text files).
        stages: Run in order for each document; a stage's ``when`` sees the outputs before it.
        store: A SQLAlchemy URL; None uses the ``ETL_DATABASE_URL`` setting (default: SQLite file).
        llm: A backend; None uses LocalLLM (SmolLM2-135M-Instruct, constrained by outlines).
        decoder: How message bytes become documents (content, key and tenant fields).
        tenant_overrides: ``{tenant: {stage name: {argument: value}}}``, e.g. other instructions or
            labels for one tenant. Overrides are part of that tenant's stage fingerprints.
        tenant_llms: ``{tenant: LLM}``: a tenant's own model.
        budgets: ``{tenant: tokens per UTC day}`` or ``{tenant: Budget(...)}``; beyond it documents
            are quarantined with reason ``budget_exceeded`` (replay them with ``etl dlq replay`` the
            next day). A ``Budget`` may name a cheaper fallback model that answers over a soft limit.
        review: Which results are sampled into the review queue (None: none).
        models: ``{name: LLM}``: candidates to compare on the golden set (``etl eval --models
            NAME,NAME``); they answer nothing in a run.
    """

    def __init__(
        self,
        name: str,
        source: Source | str | Path,
        stages: Sequence[Stage],
        store: str | None = None,
        llm: LLM | None = None,
        decoder: Decoder | None = None,
        *,
        tenant_overrides: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
        tenant_llms: Mapping[str, LLM] | None = None,
        budgets: Mapping[str, int | Budget] | None = None,
        review: ReviewSampling | None = ReviewSampling(),  # noqa: B008 - frozen, shared safely
        models: Mapping[str, LLM] | None = None,
    ) -> None:
        if not name or not name.replace("-", "_").isidentifier():
            raise ConfigError(f"pipeline name {name!r} must be letters, digits, '-' or '_'")
        if not stages:
            raise ConfigError(f"pipeline {name!r} has no stages; add a Classify or an Extract")
        self.name = name
        self.source = source if isinstance(source, Source) else source_for_path(source)
        self.stages = list(stages)
        self.store = store
        self.llm = llm
        self.decoder = decoder or Decoder()
        self.tenant_llms = dict(tenant_llms or {})
        self.budgets = {tenant: b if isinstance(b, Budget) else Budget(b) for tenant, b in (budgets or {}).items()}
        self.review = review
        self.models = dict(models or {})
        #: Where ``load_pipeline`` found it (a path or module:attr), for messages that say what to run.
        self.origin: str | None = None
        self._check()
        names = {stage.name: stage for stage in self.stages}
        self.tenant_stages: dict[str, list[Stage]] = {}
        for tenant, by_stage in (tenant_overrides or {}).items():
            unknown = sorted(set(by_stage) - set(names))
            if unknown:
                raise ConfigError(f"tenant_overrides[{tenant!r}] names unknown stage(s) {unknown}")
            self.tenant_stages[tenant] = [
                stage.override(**by_stage[stage.name]) if stage.name in by_stage else stage for stage in self.stages
            ]
        self._check_tables()
        for tenant, budget in self.budgets.items():
            if isinstance(budget.fallback, Mapping):
                unknown = sorted(set(budget.fallback) - {stage.name for stage in self.stages_for(tenant)})
                if unknown:
                    raise ConfigError(f"budgets[{tenant!r}].fallback names unknown stage(s) {unknown}")

    def stages_for(self, tenant: str) -> list[Stage]:
        """The stages as this tenant runs them (with its overrides)."""
        return self.tenant_stages.get(tenant, self.stages)

    def _check(self) -> None:
        seen: dict[str, Stage] = {}
        for stage in self.stages:
            if stage.name in seen:
                raise ConfigError(f"two stages are named {stage.name!r}; pass name= to tell them apart")
            if isinstance(stage.when, LabelIn):
                target = seen.get(stage.when.stage)
                if not isinstance(target, Classify):
                    raise ConfigError(
                        f"stage {stage.name!r}: when= refers to {stage.when.stage!r}, "
                        "which is not a Classify stage before it"
                    )
                target.check_labels(stage.when.labels, f"stage {stage.name!r} when=")
            seen[stage.name] = stage

    def _check_tables(self) -> None:
        """One schema per typed table, tenant overrides included: a table whose columns depended on
        the tenant would refuse every other tenant's rows."""
        owners: dict[str, tuple[str, Extract]] = {}
        for tenant, stages in [("", self.stages), *self.tenant_stages.items()]:
            mine: set[str] = set()
            for stage in stages:
                if not isinstance(stage, Extract):
                    continue
                who = f"tenant {tenant!r}'s stage {stage.name!r}" if tenant else f"stage {stage.name!r}"
                if stage.table in mine:
                    raise ConfigError(f"{who}: another of its stages writes table {stage.table!r} too; pass table=")
                mine.add(stage.table)
                first = owners.setdefault(stage.table, (who, stage))
                if not same_columns(first[1].schema, stage.schema):
                    raise ConfigError(
                        f"{who} writes table {stage.table!r} with schema {stage.schema.__name__}, but {first[0]} "
                        f"writes it with {first[1].schema.__name__}; give the override its own table=")

    @property
    def extract_tables(self) -> list[tuple[str, str, Any]]:
        """(stage, table, schema) of each typed table, tenant overrides' included: what
        ``Store.prepare`` creates and checks."""
        found: dict[str, tuple[str, str, Any]] = {}
        for stages in [self.stages, *self.tenant_stages.values()]:
            for s in stages:
                if isinstance(s, Extract):
                    found.setdefault(s.table, (s.name, s.table, s.schema))
        return list(found.values())

    def __repr__(self) -> str:
        return f"Pipeline(name={self.name!r}, stages={self.stages!r})"


def load_pipeline(target: str) -> Pipeline:
    """Loads ``path/to/file.py`` (its ``pipeline`` variable, or the only Pipeline in it),
    ``path/to/file.py:attr``, or ``package.module:attr``.

    Raises:
        ConfigError: the file or module is missing, fails to import, or holds no Pipeline.
    """
    where, _, attr = target.partition(":") if not Path(target).exists() else (target, "", "")
    if where.endswith(".py") or Path(where).exists():
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"pipeline file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"_etl_pipeline_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{path} failed to load: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"cannot import module {where!r}: {exc}") from exc
    if attr:
        found = getattr(module, attr, None)
        if not isinstance(found, Pipeline):
            raise ConfigError(f"{target}: {attr!r} is not a Pipeline")
    else:
        candidates = [v for v in vars(module).values() if isinstance(v, Pipeline)]
        named = getattr(module, "pipeline", None)
        found = named if isinstance(named, Pipeline) else candidates[0] if len(candidates) == 1 else None
    if found is not None:
        found.origin = target
        return found
    raise ConfigError(
        f"{target}: found {len(candidates)} Pipeline objects; name one with {target}:ATTR"
    )
