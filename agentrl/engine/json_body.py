"""JSON bodies of the engine client's requests and answers: orjson where it is installed, the standard
library otherwise (or for what orjson refuses); the same JSON values either way. A ``/generate`` carries
long token-id lists both ways, so this codec sits on the rollout's hot path.
"""

from __future__ import annotations

import json
from typing import Any

try:  # ~8x faster than the standard library on the token-id lists every /generate carries
    import orjson
except ImportError:  # pragma: no cover - the standard library then; the same JSON values either way
    orjson = None

JSON_HEADERS = {"Content-Type": "application/json"}


def dumps_json(payload: Any) -> bytes:
    """A request body: orjson where installed (compact), else ``json.dumps``; the same JSON values."""
    if orjson is not None:
        try:
            return orjson.dumps(payload)
        except TypeError:  # a type orjson does not take (a subclass of str or int, ...): the slow path
            pass
    return json.dumps(payload).encode()


def loads_json(raw: bytes) -> Any:
    """An answer's body: orjson where installed, else (or for what orjson refuses, such as ``NaN``)
    ``json.loads``. Raises ``ValueError`` when neither parses it."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except ValueError:
            pass
    return json.loads(raw)
