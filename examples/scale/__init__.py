"""A whole RL step at a model's real shape with random weights (``recipe.py``; configs beside it)."""
