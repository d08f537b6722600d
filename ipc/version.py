"""forerun's version, as the installed package says (``forerun --version``, the HTTP API's ``/version``)."""

from __future__ import annotations

from importlib import metadata


def forerun_version() -> str:
    """The installed package's version ("unknown" for a source tree run without installing it)."""
    try:
        return metadata.version("forerun")
    except metadata.PackageNotFoundError:
        return "unknown"
