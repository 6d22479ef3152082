"""`--instances-file`: the router re-reads its engines from a file that `kvpilot up` rewrites."""

from __future__ import annotations

import httpx
import pytest

from kvpilot.engine.contracts.router_args import RouterArgs, parse_instances
from kvpilot.engine.router.discovery import FileDiscovery, StaticDiscovery, make_discovery
from kvpilot.engine.router.fleet import Fleet
from kvpilot.engine.router.prefix_index import PrefixIndex


@pytest.mark.parametrize(("text", "expected"), [
    ("decode=http://a:1\ndecode=http://b:2\n", [("decode", "http://a:1"), ("decode", "http://b:2")]),
    ("http://a:1,\n\nprefill=http://b:2", [("both", "http://a:1"), ("prefill", "http://b:2")]),
    ("\n", []),
])
def test_instances_file_text(text, expected):
    assert parse_instances(text, allow_empty=True) == expected


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"instances_file": "/x"}, None),
    ({"instances_file": "/x", "instances": "http://a:1"}, "instances_file='/x' is invalid"),
    ({}, "--instances-file PATH"),
])
def test_instances_file_args(kwargs, error):
    if error is None:
        assert isinstance(make_discovery(RouterArgs(**kwargs)), FileDiscovery)
        assert isinstance(make_discovery(RouterArgs(instances="http://a:1")), StaticDiscovery)
    else:
        with pytest.raises(ValueError, match=error):
            RouterArgs(**kwargs)


def test_instances_file_flag_reaches_the_args():
    from kvpilot.cli.main import build_parser
    from kvpilot.engine.contracts.args import from_namespace

    parsed = build_parser("route").parse_args(["route", "--instances-file", "/tmp/f"])
    assert from_namespace(RouterArgs, parsed).instances_file == "/tmp/f"


async def test_fleet_follows_the_file_and_keeps_the_last_list_when_it_breaks(tmp_path):
    path = tmp_path / "instances"
    fleet = Fleet(FileDiscovery(str(path)), PrefixIndex(1000), eject_after=3, eject_seconds=1)
    client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text="")))
    steps = [  # (file text or None to delete it, instance URLs the fleet then knows)
        ("decode=http://a:1,decode=http://b:2", ["http://a:1", "http://b:2"]),
        ("decode=http://b:2", ["http://b:2"]),                  # scale-down: a is gone
        ("decode=http://b:2\ndecode=http://c:3", ["http://b:2", "http://c:3"]),
        (None, ["http://b:2", "http://c:3"]),                    # unreadable: keep the list
        ("decode=not-a-url", ["http://b:2", "http://c:3"]),      # malformed: keep the list
        ("", []),                                                # scaled to zero
    ]
    async with client:
        for text, expected in steps:
            if text is None:
                path.unlink()
            else:
                path.write_text(text)
            await fleet.refresh(client)
            assert sorted(fleet.instances) == expected
