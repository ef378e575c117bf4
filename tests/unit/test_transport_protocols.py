"""The weight transport Protocols say what roles call, and every transport has it: roles hold a
`RendezvousTransport` / `PullTransport`, never a wrapper that asks which class it got."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rolectl.bus.weights.base import PullTransport, RendezvousTransport
from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.cuda_ipc import CudaIpcTransport
from rolectl.bus.weights.torch_dist import TorchDistTransport

ROOT = Path(__file__).resolve().parents[2]


def _rendezvous_transports():
    return [TorchDistTransport(), CudaIpcTransport()]


@pytest.mark.parametrize("transport", _rendezvous_transports(), ids=lambda t: type(t).__name__)
def test_rendezvous_transports_offer_a_port_and_receive_into_every_local_rank(transport):
    assert isinstance(transport, RendezvousTransport)
    port = transport.offer_port()
    assert isinstance(port, int) and 0 < port < 65536
    also_into = inspect.signature(transport.receive).parameters["also_into"]
    assert also_into.kind is inspect.Parameter.KEYWORD_ONLY and also_into.default == ()


def _protocol_members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def test_roles_call_only_what_the_protocols_declare():
    declared = _protocol_members(PullTransport) | _protocol_members(RendezvousTransport)
    called = set()
    for path in (ROOT / "roles" / "trainer.py", ROOT / "roles" / "explorer.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # self.transport.<name>
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "transport" and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "self"):
                called.add(node.attr)
    assert {"offer_port", "send", "receive", "publish", "fetch"} <= called  # the scan sees the calls
    assert called - declared == set()


def test_checkpoint_is_a_pull_transport(tmp_path):
    assert isinstance(CheckpointTransport(tmp_path), PullTransport)
