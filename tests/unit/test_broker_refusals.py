"""Which refusals of the broker stop an agent at once (exit 2, not restarted) and which are
waited out: a wrong password or an ACL's "Not authorized" never changes on a retry, while a
busy, unavailable or rate-limiting broker (EMQX and HiveMQ say so under a mass start) or a
full quota does. No broker: paho's own reason codes."""

from __future__ import annotations

import collections

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from wire import roles
from wire.mqtt_connect import note_refusal


@pytest.mark.parametrize(
    ("code", "final"),
    [(0x86, True), (0x87, True), (0x8A, True), (0x88, False), (0x89, False), (0x9F, False)],
)
def test_only_a_refusal_no_retry_changes_stops_the_connection(code: int, final: bool) -> None:
    refusals: list[str] = []
    note_refusal(ReasonCode(PacketTypes.CONNACK, identifier=code), refusals)  # type: ignore[no-untyped-call]
    assert bool(refusals) is final, refusals


class _Control:
    def __init__(self, **refused: int) -> None:
        self.refused = collections.Counter(refused)


def test_an_announcement_is_denied_only_by_what_an_acl_answers() -> None:
    before = collections.Counter({"Not authorized": 1})
    busy = _Control(**{"Quota exceeded": 3, "Unspecified error": 1, "Not authorized": 1})
    assert not roles._denied(busy, before)  # type: ignore[arg-type]
    denied = _Control(**{"Quota exceeded": 3, "Not authorized": 2})
    assert roles._denied(denied, before) == {"Not authorized": 1}  # type: ignore[arg-type]
