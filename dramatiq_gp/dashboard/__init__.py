"""The web dashboard: queues, workers, the scheduler, the outbox, dead letters and recent failures.

Serve it with ``dramatiq-gp dashboard`` or mount :func:`create_app` in a Starlette
or FastAPI application. It needs the ``dashboard`` extra (Starlette, Jinja2,
uvicorn); its pages are server-rendered HTML with one stylesheet, no JavaScript
build and nothing fetched from elsewhere. See ``docs/dashboard.md``.
"""

from .access import Credentials, loopback
from .app import create_app

__all__ = ["Credentials", "create_app", "loopback"]
