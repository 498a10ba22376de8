"""``python -m dniasync.compare``: one job under many methods through the launcher, a table and figures.

The top floor of the package: it runs ``dniasync.node`` (as processes) and reads the cluster's config
schema, mode and rule registries and run summaries; nothing imports it. :func:`main` is the whole interface.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
