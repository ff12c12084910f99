"""The brokers the kit's middleware can rely on: each one a :class:`~dramatiq_gp.brokers.base.KitBroker`.

:class:`~dramatiq_gp.brokers.redis.RedisBroker` holds the queues in Redis/Valkey;
:class:`~dramatiq_gp.brokers.rabbitmq.RabbitmqBroker` in RabbitMQ, with Redis/Valkey
beside it for the coordination state.
"""
