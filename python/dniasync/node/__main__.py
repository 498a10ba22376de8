"""``python -m dniasync.node``: see :func:`dniasync.node.cli.main`."""

from .cli import exit_now, main

exit_now(main())
