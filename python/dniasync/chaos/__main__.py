import sys

from ._tool import main

sys.exit(main())
