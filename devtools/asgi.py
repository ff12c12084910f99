"""An ASGI application served by uvicorn in a thread, for the dashboard's tests and benchmark."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port (its lifespan run); yields its base URL."""
    import uvicorn

    # IPPROTO_TCP said, not 0: asyncio sets TCP_NODELAY on the accepted connections only then, as it does on the
    # sockets uvicorn makes itself (``dramatiq-gp dashboard``). Without it each response waits ~40 ms for the
    # client's delayed ACK, the headers and the body being two writes.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
