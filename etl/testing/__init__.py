"""What ships for testing pipelines without a real model or a real provider: ``FakeLLM`` (scripted
answers, latency and faults, every call recorded), ``FaultServer`` (an OpenAI-wire chat server with
scripted faults) and ``BatchServer`` (OpenAI's and Anthropic's batch wires), all on 127.0.0.1.

They stand in for *remote* providers only; tests of the data path use the real store, broker and
local model.
"""

from connectors.sources import ListSource
from etl.testing.batch_server import BatchServer
from etl.testing.fakes import FakeLLM, lognormal, schema_answer, simulated_labeller, unstable, value_logprobs
from etl.testing.fault_server import FaultServer

__all__ = ["BatchServer", "FakeLLM", "FaultServer", "ListSource", "lognormal", "schema_answer", "simulated_labeller", "unstable", "value_logprobs"]
