"""Command-line entry points (``megapar-train``, ``megapar-data``, ...)."""
