"""The one place the broker kind is chosen: RabbitMQ when ``BROKER_URL`` is set, else Redis/Valkey.

The kit builds its broker here (:func:`broker_for`), and the operator's tools their
view of the queues (:func:`view_for`); past this point nothing asks which kind it has.
"""

from __future__ import annotations

from typing import Any

import redis
from dramatiq import Middleware

from ..settings import Settings
from .base import KitBroker
from .view import QueueView


def broker_for(settings: Settings, client: redis.Redis, middleware: list[Middleware], **options: Any) -> KitBroker:
    """The broker the settings name, with the kit's coordination ``client``; ``options`` go to its class."""
    rabbitmq = settings.rabbitmq
    options.setdefault("namespace", settings.redis.namespace)
    if rabbitmq.url is None:
        from .redis import RedisBroker

        return RedisBroker(client=client, middleware=middleware, **options)
    from .rabbitmq import RabbitmqBroker

    urls = rabbitmq.urls()
    options.setdefault("queue_type", rabbitmq.queue_type)
    options.setdefault("confirm_timeout_ms", rabbitmq.confirm_timeout.total_seconds() * 1000)
    return RabbitmqBroker(url=urls if len(urls) > 1 else urls[0], client=client, middleware=middleware, **options)


def view_for(settings: Settings, client: redis.Redis) -> QueueView:
    """The operator's view of the queues the settings name; ``client`` is the coordination Redis/Valkey."""
    if settings.rabbitmq.url is None:
        from .redis_view import RedisQueueView

        return RedisQueueView(client, settings.redis.namespace, settings.redis.display())
    from .rabbitmq_view import RabbitmqQueueView

    return RabbitmqQueueView(settings.rabbitmq.urls(), client, settings.redis.namespace, settings.rabbitmq.display())
