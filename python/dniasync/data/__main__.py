"""``python -m dniasync.data convert SRC DEST`` / ``verify DEST``."""

import sys

from dniasync.train.data.convert import main

sys.exit(main())
