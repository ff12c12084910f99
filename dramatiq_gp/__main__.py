"""``python -m dramatiq_gp`` is ``dramatiq-gp``."""

from .cli import main

main()
