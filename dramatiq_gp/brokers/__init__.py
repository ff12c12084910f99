"""The brokers the kit's middleware can rely on: :class:`~dramatiq_gp.brokers.redis.RedisBroker`."""
