"""``python -m agentrl.viewer RUN_DIR [-o view.html] [--serve [--port N]]``: see :mod:`agentrl.viewer`."""

from __future__ import annotations

import argparse
import http.server
import sys
from pathlib import Path

from agentrl.episodes import DumpError
from agentrl.viewer import build_page


def serve(run_dir: Path, port: int = 0) -> None:
    """Serve the run's page on 127.0.0.1 (built again on each load, so a running run's new steps show)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/", "/index.html"):
                self.send_error(404)
                return
            body = build_page(run_dir).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler) as srv:
        print(f"serving {run_dir} on http://127.0.0.1:{srv.server_address[1]}/ (Ctrl-C stops)", flush=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentrl.viewer", description="Browse a run's episode dumps.")
    p.add_argument("run", help="the run's output_dir (with trajectories/)")
    p.add_argument("-o", "--out", help="write the page here (default: <run>/view.html)")
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 instead")
    p.add_argument("--port", type=int, default=0, help="with --serve: the port (default: a free one)")
    args = p.parse_args(argv)
    run_dir = Path(args.run)
    try:
        if args.serve:
            build_page(run_dir)  # fail now, not at the first request
            serve(run_dir, args.port)
            return 0
        out = Path(args.out) if args.out else run_dir / "view.html"
        build_page(run_dir, out)
    except (FileNotFoundError, DumpError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
