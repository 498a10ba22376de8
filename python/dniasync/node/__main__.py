"""``python -m dniasync.node``: see :func:`dniasync.node.cli.main`."""

from .cli import main

raise SystemExit(main())
