"""Examples that run as they are (installed as ``agentrl.examples``).

* ``custom_env.py``: a multi-turn env that scores itself (guess a number); ``custom_env.yaml`` trains it.
* ``custom_verifier.py``: a reward verifier and a one-turn env that names it.
* ``openai_agent.py``: a tool-using agent in plain openai-SDK code; ``openai_agent.yaml`` trains it on a
  CPU in about a minute (``openai_agent_recipe.py`` builds its tiny model and tasks).
* ``search_r1/``: the Search-R1 demo, ``python train_async.py``'s default run.

The README shows excerpts of these files; ``tests/test_docs.py`` checks that they match and run.
"""
