"""Search-R1 style tool-use training: data, retrieval and the synthetic world the CPU demo learns on.

* :mod:`.data` -- the Search-R1 data format (parquet tasks, jsonl corpus) and its loaders.
* :mod:`.world` -- a deterministic synthetic world written in that format, and gold demonstrations.
* :mod:`.retrieval_server` -- BM25 retrieval: in-process :class:`RetrievalIndex` and the ``/retrieve`` server.
* :mod:`.retrieval_workers` -- the server's worker processes on one port, their counters and load.
* :mod:`.bootstrap` -- the CPU demo's warm start: world, tiny model, SFT (cached).
* :mod:`.recipe` -- the demo as a ``train_async.py`` recipe: :class:`SearchR1Config` (the run config plus
  ``bootstrap`` and ``retrieval``) and :class:`SearchR1Recipe` (its hooks; see :mod:`agentrl.recipe`).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy exports (PEP 562): ``python -m agentrl.examples.search_r1.world`` must not find its own module
# already imported by the package (runpy warns about that), and users of the loader need no aiohttp.
_EXPORTS = {
    "data": [
        "SEARCH_R1_TEMPLATE",
        "Passage",
        "Task",
        "extract_question",
        "format_docs",
        "iter_corpus",
        "load_tasks",
        "make_prompt",
        "write_corpus",
        "write_tasks",
    ],
    "recipe": ["SearchR1Config", "SearchR1Recipe"],
    "retrieval_server": ["RetrievalIndex", "RetrievalServer", "ServerLimits", "start_retrieval_server"],
    "world": [
        "INFORMATION_TEMPLATE",
        "WORLD_FORMAT_VERSION",
        "Demo",
        "World",
        "WorldConfig",
        "generate_world",
        "gold_demo",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
