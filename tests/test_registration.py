"""Declaring events and registering listeners: names, shapes, options, and clear errors."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum

import pydantic
import pytest

import dramatiq_gp as gp


class Colour(Enum):
    RED = "red"


@gp.event("test.reg.rich")
@dataclass(frozen=True)
class Rich:
    id: uuid.UUID
    at: datetime
    colour: Colour
    tags: tuple[str, ...]


@gp.event("test.reg.model")
class Model(pydantic.BaseModel):
    name: str


def test_payloads_round_trip_through_json():
    event = Rich(uuid.uuid4(), datetime(2026, 1, 2, 3, 4, tzinfo=UTC), Colour.RED, ("a", "b"))
    kind = gp.event_type(event)
    data = kind.encode(event)
    assert data["colour"] == "red"
    assert kind.decode(data) == event
    assert gp.event_type(Model).decode(gp.event_type(Model).encode(Model(name="x"))) == Model(name="x")


def test_a_field_of_the_wrong_type_is_an_encoding_error():
    with pytest.raises(gp.EventEncodeError, match=r"test\.reg\.rich"):
        gp.event_type(Rich).encode(Rich("not-a-uuid", datetime.now(UTC), Colour.RED, ()))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "has:colon", "spaces no", 3])
def test_event_names_are_checked(name):
    with pytest.raises(gp.EventError, match="event name"):
        gp.event(name)


def test_a_wire_name_belongs_to_one_class():
    with pytest.raises(gp.EventError, match=r"already used by .*Rich"):

        @gp.event("test.reg.rich")
        @dataclass
        class Impostor:
            x: int


def test_subclasses_do_not_inherit_the_wire_name():
    @dataclass(frozen=True)
    class Child(Rich):
        extra: int = 0

    with pytest.raises(gp.EventError, match="not an event type"):
        gp.event_type(Child)


def _ok(event: Rich) -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"handler": lambda e: None}, "give it a name="),
        ({"handler": _ok, "queue": "no spaces"}, "is not a queue name"),
        ({"handler": lambda: None, "name": "noargs"}, "must take the event as its one argument"),
        ({"handler": lambda a, b: None, "name": "two"}, "must take the event as its one argument"),
        ({"handler": "not callable", "name": "str"}, "is not callable"),
        ({"handler": _ok, "colour": "blue"}, "unknown option(s) colour"),
    ],
)
def test_bad_registrations_are_refused_with_the_listener_named(make_kit, kwargs, message):
    registry = gp.Registry()
    make_kit(registry=registry)
    handler = kwargs.pop("handler")
    with pytest.raises(gp.RegistrationError) as raised:
        registry.listen(Rich, handler, **kwargs)
    assert message in str(raised.value)
    assert "test.reg.rich" in str(raised.value)


def test_async_handlers_are_accepted_and_their_shape_checked_like_plain_ones():
    async def handler(event: Rich) -> None:
        pass

    async def two(event: Rich, other: int) -> None:
        pass

    registry = gp.Registry()
    assert registry.listen(Rich, handler).handler is handler
    with pytest.raises(gp.RegistrationError, match="the handler must take the event as its one argument"):
        registry.listen(Rich, two)


def test_the_same_listener_name_twice_is_refused():
    registry = gp.Registry()
    registry.listen(Rich, _ok)
    with pytest.raises(gp.RegistrationError, match="registered twice"):
        registry.listen(Rich, lambda e: None, name="_ok")


def test_both_styles_declare_one_actor_per_listener_with_its_options(make_kit):
    registry = gp.Registry()

    @registry.listener(Rich, queue="mail", max_retries=3, time_limit=5000)
    def send_mail(event: Rich) -> None:
        pass

    kit = make_kit(lambda reg, schedule: reg.listen(Rich, _ok, name="audit"), registry=registry)
    mail = kit.broker.get_actor("listener:test.reg.rich:send_mail")
    audit = kit.broker.get_actor("listener:test.reg.rich:audit")
    assert (mail.queue_name, mail.options["max_retries"], mail.options["time_limit"]) == ("mail", 3, 5000)
    assert mail.options["idempotent"] and audit.queue_name == "default"
    assert send_mail(None) is None  # the decorated function is still the plain function
    assert {listener.name for listener in registry.listeners(Rich)} == {"send_mail", "audit"}
