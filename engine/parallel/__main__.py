"""``python -m engine.parallel``: a rank other than 0, as rank 0 starts it (engine.parallel.worker)."""

import sys

from engine.parallel.worker import main

sys.exit(main())
