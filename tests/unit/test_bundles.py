"""Bundles (``wire.bundles``): the frame round-trips, a broken one is refused whole, and held
payloads keep their order in runs per topic."""

from __future__ import annotations

import struct

import pytest

from wire.bundles import BUNDLE_MAGIC, MAX_PARTS, Held, bundle, holdable, is_bundle, unbundle
from wire.errors import WireError

pytestmark = pytest.mark.unit


def test_parts_round_trip_in_order() -> None:
    parts = [b"a", b"bb" * 1000, BUNDLE_MAGIC + b"inner"]  # a part that looks like a bundle
    data = bundle(parts)
    assert is_bundle(data)
    assert unbundle(data) == parts  # split once: the inner one stays a part


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"ESB", "truncated"),
        (b"ESW1" + struct.pack("<I", 1), "bad magic"),
        (BUNDLE_MAGIC + struct.pack("<I", 0), "outside"),
        (BUNDLE_MAGIC + struct.pack("<I", MAX_PARTS + 1), "outside"),
        (BUNDLE_MAGIC + struct.pack("<II", 2, 3), "ends in their lengths"),
        (BUNDLE_MAGIC + struct.pack("<II", 1, 0), "length 0"),
        (BUNDLE_MAGIC + struct.pack("<II", 1, 5) + b"abcd", "4 present"),
        (BUNDLE_MAGIC + struct.pack("<II", 1, 3) + b"abcd", "4 present"),
        (BUNDLE_MAGIC + struct.pack("<III", 2, 0xFFFFFFFF, 1) + b"ab", "present"),
    ],
)
def test_a_broken_frame_is_refused_whole(data: bytes, says: str) -> None:
    with pytest.raises(WireError, match=says) as caught:
        unbundle(data)
    assert caught.value.reason == "bundle"


def test_bundle_refuses_what_it_cannot_frame() -> None:
    with pytest.raises(ValueError, match="1 to"):
        bundle([])
    with pytest.raises(ValueError, match="empty part"):
        bundle([b"x", b""])


def test_held_runs_follow_topics_and_size() -> None:
    held = Held(bundle_bytes=10)
    for topic, payload in [("a", b"1234"), ("a", b"5678"), ("a", b"90"), ("a", b"x"), ("b", b"y")]:
        held.add(topic, payload)
    held.add("a", b"z")
    assert held.bytes == 13
    runs = []
    while held:
        runs.append(held.take())
    assert runs == [
        ("a", [b"1234", b"5678", b"90"]),  # 10 bytes: the next one starts a new run
        ("a", [b"x"]),
        ("b", [b"y"]),
        ("a", [b"z"]),  # after another topic: a run of its own, so the order holds
    ]
    assert held.bytes == 0


def test_a_run_put_back_goes_first() -> None:
    held = Held(bundle_bytes=100)
    held.add("a", b"1")
    held.add("b", b"2")
    topic, parts = held.take()
    held.put_back(topic, parts)
    assert held.take() == ("a", [b"1"]) and held.bytes == 1
    assert held.clear() == 1 and not held and held.bytes == 0


def test_only_small_payloads_to_plain_topics_are_held() -> None:
    assert holdable("edgesplit/v1/a", b"x" * 100, False, 1024)
    assert not holdable("edgesplit/v1/a", b"x" * 257, False, 1024)  # above a quarter
    assert not holdable("edgesplit/v1/a", b"", False, 1024)
    assert not holdable("edgesplit/v1/a", b"x", True, 1024)  # retained
    assert not holdable("edgesplit/v1/a", b"x", False, 0)  # bundles off
    for topic in ("edgesplit/+/a", "edgesplit/#", "", "bad\udc80", "t" * 70_000):
        assert not holdable(topic, b"x", False, 1024), topic  # paho refuses: the caller hears
