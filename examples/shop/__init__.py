"""The shop: a small application built on dramatiq-gp, used by the demo and the docs."""
