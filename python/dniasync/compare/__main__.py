"""``python -m dniasync.compare``: see :func:`dniasync.compare.cli.main`."""

from .cli import main

raise SystemExit(main())
