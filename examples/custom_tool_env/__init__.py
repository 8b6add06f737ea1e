"""A custom tool env on a CPU, warm-started from demonstrations so that its first RL run makes tool calls.

* ``env.py``: ``UnitConversionEnv`` (a ``ToolEnv`` with a calculator tool) and the ``unit_conversion``
  verifier (partial credit for near answers);
* ``demos.py``: a scripted expert that plays the env and writes demonstrations (``agentrl.sft`` format);
* ``recipe.py``: builds a tiny model and its SFT warm start (cached), then hands it to RL;
* ``config.yaml``: ``python train_async.py --config examples/custom_tool_env/config.yaml``.
"""
