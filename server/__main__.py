"""``python -m server serve ...``"""

import sys

from server.cli import main

sys.exit(main())
