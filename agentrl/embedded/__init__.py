"""The embedded engine: a stand-in for SGLang that serves SGLang's native HTTP API (and OpenAI's) for one
Hugging Face causal LM on CPU or one GPU, with continuous batching over a slot KV cache, prefix reuse,
CUDA graphs and every weight-update path an RL run uses. It is not SGLang; on GPU clusters agentrl
launches real SGLang servers (:mod:`agentrl.engine.launcher`) and talks to both the same way.

``python -m agentrl.embedded.server --model DIR`` starts one;
:func:`agentrl.embedded.launch.start_embedded_server` starts one from Python. The modules, from the top:
``server`` (the process), ``launch`` (starting it), ``native_api`` (SGLang's endpoints), ``openai_backend``
(OpenAI's, in process), ``engine`` (requests, pause, weight updates), ``scheduler`` (continuous batching),
``runner`` (the forward), ``speculative`` (drafts and their verification), ``request``, ``sampling``,
``prefix_cache``, ``weights``.
"""
