"""Test doubles that tests, benchmarks and the CLI's ``--load-format scripted`` share.

Production code never imports this package, except the process shell, lazily, for
``load_format == "scripted"`` (the overlap benchmark runs a real scheduler against it).
"""
