"""The embedded engine's server under its earlier name: ``python -m agentrl.engine.embedded_server`` and
``from agentrl.engine.embedded_server import start_embedded_server`` keep working; the code lives in
:mod:`agentrl.embedded.server`."""

from agentrl.embedded.server import EmbeddedServer, main, start_embedded_server

__all__ = ["EmbeddedServer", "main", "start_embedded_server"]

if __name__ == "__main__":
    main()
