"""Run-config fragments for CI-sized runs of the real main job (tests and benchmarks).

:data:`TINY_SEARCH_R1` is the Search-R1 recipe on a tiny model and world: the recipe line, the bootstrap
(40-entity world, a 2-layer model, 5 SFT steps) and the env. It is a ``str.format`` template with one field,
``{cache}`` (the bootstrap's cache dir); its braces are doubled, so a caller appends it to its own template
and formats the whole once.
"""

TINY_SEARCH_R1 = """recipe: agentrl.examples.search_r1.recipe:SearchR1Recipe
bootstrap:
  cache_dir: {cache}
  world: {{seed: 0, num_entities: 40}}
  model: {{vocab_size: 600, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
          num_key_value_heads: 1, intermediate_size: 64}}
  sft: {{steps: 5, batch_size: 4, think: false, practice_worlds: 2, practice_entities: 40, search_prob: 0.35,
        calibration_steps: 5}}
env: {{name: search, kwargs: {{max_turns: 2}}}}
"""
