"""Episode viewer page load: a synthetic run dump of N episodes (10,000 by default) and a 100-episode
baseline, each written as the viewer's page and loaded in headless Chromium.

    python bench/viewer.py [--episodes 10000] [--baseline 100] [--repeats 3]

Prints one JSON line. Per size: the page's size, the time to build it from the dumps (Python), and in the
browser (median over the repeats, a fresh page load each time) ``load_ms``, from navigation start to the
viewer's first render (list and first episode shown; ``performance.now()`` at that point), and
``open_ms``, the time to open the last episode (parse its detail, render its turns and its tokens
coloured by logprob).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from agentrl.testing.browser import Chromium
from agentrl.testing.episodes import synthetic_run
from agentrl.viewer import build_page

OPEN_LAST = """(() => {
  const t = performance.now();
  document.getElementById('f-color').value = 'logprob';
  window.agentrlViewer.select(ROWS.length - 1);
  document.getElementById('detail').offsetHeight;  // force layout
  return performance.now() - t;
})()"""


async def measure(page: Path, repeats: int) -> dict[str, float]:
    loads, opens = [], []
    async with Chromium() as b:
        for _ in range(repeats):
            await b.goto(page.as_uri())
            loads.append(await b.wait_for("window.agentrlViewerReady", timeout=300))
            opens.append(await b.evaluate(OPEN_LAST))
            if b.page_errors():
                raise RuntimeError(f"page errors: {b.page_errors()}")
    return {"load_ms": round(statistics.median(loads), 1), "open_ms": round(statistics.median(opens), 2)}


def one_size(tmp: Path, episodes: int, repeats: int) -> dict[str, float]:
    run = synthetic_run(tmp / f"run{episodes}", episodes)
    t = time.perf_counter()
    page = tmp / f"view{episodes}.html"
    build_page(run, page)
    build_s = time.perf_counter() - t
    return {
        "episodes": episodes,
        "page_mb": round(page.stat().st_size / 2**20, 2),
        "build_s": round(build_s, 2),
        **asyncio.run(measure(page, repeats)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=10_000)
    p.add_argument("--baseline", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-viewer-") as tmp:
        baseline = one_size(Path(tmp), args.baseline, args.repeats)
        result = one_size(Path(tmp), args.episodes, args.repeats)
    print(json.dumps({"bench": "viewer", **result, "repeats": args.repeats, "baseline": baseline}))


if __name__ == "__main__":
    main()
