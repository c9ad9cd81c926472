"""The public API is what ``etl.__all__`` says, and nothing we rely on is missing from it."""

import importlib

import etl


def test_all_names_resolve_and_are_unique() -> None:
    assert len(etl.__all__) == len(set(etl.__all__))
    for name in etl.__all__:
        assert getattr(etl, name) is not None, name


def test_the_declaration_api_is_public() -> None:
    for name in ("Pipeline", "Classify", "Extract", "label_in", "LocalLLM", "Settings", "run_pipeline", "EtlError"):
        assert name in etl.__all__


def test_internal_packages_import_without_side_effects() -> None:
    for name in ("schemas", "dedup", "connectors", "connectors.sources", "connectors.store"):
        module = importlib.import_module(name)
        assert module.__name__ == name


def test_errors_say_whether_they_are_retryable() -> None:
    assert etl.TransientLLMError("x").retryable
    for error in (etl.SchemaInvalid, etl.Truncated, etl.Refusal, etl.ConfigError, etl.BadInput, etl.ContextOverflow):
        assert not error("x").retryable
    assert etl.Truncated("x").reason == "truncated" and etl.SchemaInvalid("x").reason == "schema_invalid"
