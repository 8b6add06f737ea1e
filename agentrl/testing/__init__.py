"""The test kit: stand-ins that tests and benchmarks drive the real parts with. Not used by a run.

* :mod:`agentrl.testing.stub_engine`: an SGLang-protocol HTTP server with no model behind it (random or
  scripted tokens, latency and failure injection), for the orchestrator's tests and benchmarks.
* :mod:`agentrl.testing.envs`: synthetic envs (fixed turns, tool latency, injected errors, random
  terminal rewards).
* :mod:`agentrl.testing.verifiers`: rewards that need no trained model (``length_parity``).
* :mod:`agentrl.testing.configs`: run-config fragments for CI-sized runs of ``train_async.py``.
* :mod:`agentrl.testing.gpus`: the machine's GPU behind a test process's GPU, for the servers a GPU test
  starts on a GPU of their own.

The real parts they stand beside: the embedded engine (:mod:`agentrl.embedded.server`), SGLang, and
the built-in envs (:mod:`agentrl.envs`).
"""
