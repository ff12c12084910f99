"""Events: typed payloads with a stable wire name, carried as JSON.

An event is a dataclass (or a pydantic model, or a TypedDict) decorated with
:func:`event`, which gives it the name it travels under. Renaming the class or
moving its module does not change that name, so messages already queued keep
reaching their listeners. Payloads are encoded and decoded by pydantic, so
``datetime``, ``Decimal``, ``UUID``, enums and nested dataclasses round-trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError
from pydantic_core import PydanticSerializationError

from .errors import EventEncodeError, EventError, PayloadMismatch, one_line_at_start_up
from .names import NAME

#: Wire names (and listener names) become part of actor names, where ``:`` separates parts.

T = TypeVar("T")

_by_name: dict[str, EventType] = {}


@dataclass(frozen=True, eq=False)
class EventType:
    """What the kit knows about one event class."""

    name: str
    cls: type[Any]
    adapter: TypeAdapter[Any]

    def encode(self, event: object) -> Any:
        """The event as JSON-ready data.

        Raises:
            EventEncodeError: a field holds a value that is not JSON-encodable or
                does not match its annotation.
        """
        if not isinstance(event, self.cls):
            raise EventEncodeError(
                f"expected a {self.cls.__qualname__} for event {self.name!r}, got a {type(event).__qualname__}"
            )
        try:
            return self.adapter.dump_python(event, mode="json", warnings="error")
        except PydanticSerializationError as exc:
            # The event's repr stays out: error messages end up in logs and Sentry, payloads must not.
            raise EventEncodeError(f"cannot encode event {self.name!r}: {exc}") from exc

    def decode(self, data: Any) -> Any:
        """The event ``data`` holds.

        A field the class does not have is ignored, and one it has with a default
        may be missing: so an event written by another version of the application
        decodes here as long as every field this class requires is there, of its type.

        Raises:
            PayloadMismatch: it is not; the message names each field and the problem, never the values.
        """
        try:
            return self.adapter.validate_python(data)
        except ValidationError as exc:
            # Pydantic's own text quotes the input: error messages end up in logs and dead letters.
            problems = "; ".join(
                f"field {'.'.join(map(str, e['loc'])) or '(the payload)'!r}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            raise PayloadMismatch(
                f"event {self.name!r} does not fit this version's {self.cls.__qualname__}: {problems}"
            ) from None

    def __repr__(self) -> str:
        return f"EventType({self.name!r}, {self.cls.__qualname__})"


@one_line_at_start_up
def event(name: str) -> Any:
    """Class decorator: make ``cls`` an event travelling under ``name``.

    Example::

        @dramatiq_gp.event("shop.order_placed")
        @dataclass(frozen=True)
        class OrderPlaced:
            order_id: int

    Raises:
        EventError: the name is malformed or taken by another class, or pydantic
            cannot encode the class.
    """
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise EventError(f"event name {name!r} must be letters, digits, '_', '.', '-' (no ':')")

    @one_line_at_start_up
    def decorate(cls: type[T]) -> type[T]:
        taken = _by_name.get(name)
        if taken is not None and _path(taken.cls) != _path(cls):
            raise EventError(f"event name {name!r} is already used by {_path(taken.cls)}")
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(cls)
        except PydanticSchemaGenerationError as exc:
            raise EventError(
                f"{cls.__qualname__} cannot be an event: use a dataclass or a pydantic model ({exc})"
            ) from exc
        # Kept in the class's own namespace so subclasses do not inherit the name.
        cls.__gp_event__ = EventType(name, cls, adapter)  # type: ignore[attr-defined]
        _by_name[name] = cls.__gp_event__  # type: ignore[attr-defined]
        return cls

    return decorate


def event_type(event_or_class: object) -> EventType:
    """The :class:`EventType` of an event instance or class.

    Raises:
        EventError: it was not declared with :func:`event`.
    """
    cls = event_or_class if isinstance(event_or_class, type) else type(event_or_class)
    declared = cls.__dict__.get("__gp_event__")
    if declared is None:
        raise EventError(f"{cls.__qualname__} is not an event type: decorate it with @dramatiq_gp.event('some.name')")
    return declared  # type: ignore[no-any-return]


def event_type_named(name: str) -> EventType | None:
    """The event type declared in this process under wire name ``name``, if any."""
    return _by_name.get(name)


def declared_events() -> tuple[EventType, ...]:
    """Every event type declared in this process."""
    return tuple(_by_name.values())


def _path(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
