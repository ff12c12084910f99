"""``python -m dramatiq_gp`` is ``dramatiq-gp``."""

import sys

from .cli import main

sys.exit(main())
