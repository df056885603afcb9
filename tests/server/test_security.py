"""Security: TCP tokens, namespaces, file permissions, refusal before any engine call."""

from __future__ import annotations

import os
import stat

import pytest

from pie_ctx.errors import AuthError, InvalidArgument, SnapshotNotFound
from pie_ctx.proto import address as endpoint
from pie_ctx.proto import messages as P
from runtime.server.run import open_listener, settle_token
from runtime.server.server import Server
from runtime.server.testing import serve_in_background
from tests.server.helpers import connect, fake_engine, wait_settled


class _Spy:
    """Counts every engine call; the refused clients must cause none."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls = 0

    def __getattr__(self, name):
        if name in ("handle", "generate", "release_owner"):
            self.calls += 1
        return getattr(self.engine, name)


async def test_tcp_refuses_missing_and_wrong_tokens_before_the_engine():
    engine = fake_engine()
    async with engine, serve_in_background(engine, tcp=True, run_engine=False) as srv:
        spy = _Spy(engine)
        srv.server.engine = spy
        with pytest.raises(AuthError, match="requires a token"):
            async with connect(srv.address):
                pass
        with pytest.raises(AuthError, match="wrong token"):
            async with connect(srv.address, token=srv.token + "x"):
                pass
        with pytest.raises(AuthError, match="wrong token"):
            async with connect(srv.address, token=""):
                pass
        assert spy.calls == 0
        async with connect(srv.address, token=srv.token) as t:
            assert (await t.request(P.CreateContext())).ctx > 0
        await wait_settled(engine)


def test_tcp_server_cannot_run_without_a_token():
    with pytest.raises(ValueError):
        Server(fake_engine(), require_token=True)


async def test_namespaces_are_isolated():
    engine = fake_engine()
    async with serve_in_background(engine, tcp=True, extra_tokens=("bob-token",)) as srv:
        async with connect(srv.address, token=srv.token) as alice, \
                connect(srv.address, token="bob-token") as bob, \
                connect(srv.address, token=srv.token, namespace="experiments") as alice_sub:
            assert len({alice.namespace, bob.namespace, alice_sub.namespace}) == 3
            assert srv.token not in alice.namespace  # the namespace never reveals the token
            a = (await alice.request(P.CreateContext())).ctx
            await alice.request(P.Forward(ctx=a, tokens=[1, 2, 3]))
            await alice.request(P.SaveSnapshot(ctx=a, name="secret"))
            for other in (bob, alice_sub):
                assert (await other.request(P.ListSnapshots())).names == []
                for req in (P.OpenSnapshot(name="secret"), P.TakeSnapshot(name="secret"),
                            P.DeleteSnapshot(name="secret")):
                    with pytest.raises(SnapshotNotFound):
                        await other.request(req)
            b = (await bob.request(P.CreateContext())).ctx
            await bob.request(P.SaveSnapshot(ctx=b, name="secret"))  # same name, own namespace
            assert (await alice.request(P.OpenSnapshot(name="secret"))).state.seq_len == 3
            for t in (alice, bob, alice_sub):
                await t.aclose()
            assert sorted(engine.store.list_snapshots(alice.namespace)) == ["secret"]
            assert sorted(engine.store.list_snapshots(bob.namespace)) == ["secret"]


def test_token_file_is_created_0600_and_loose_files_are_refused(tmp_path):
    path = tmp_path / "tok"
    token, written = settle_token(endpoint.Address("tcp", host="127.0.0.1"), None, str(path))
    assert written == str(path) and token and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert endpoint.read_token_file(path) == token
    # An existing token file is reused, not overwritten.
    assert settle_token(endpoint.Address("tcp", host="127.0.0.1"), None, str(path))[0] == token
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgument, match="other users"):
        endpoint.read_token_file(path)
    # Rewriting resets the mode even though the file already exists.
    endpoint.write_token_file(path, "t2")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert settle_token(endpoint.Address("unix", path="/x"), None, None) == (None, None)


def test_runtime_dir_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = endpoint.runtime_dir()
    assert d == tmp_path / "pie-ctx" and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert endpoint.default_socket_path().startswith(str(d))
    os.chmod(d, 0o755)
    assert stat.S_IMODE(endpoint.runtime_dir().stat().st_mode) == 0o700


async def test_unix_socket_is_0600_and_a_live_server_is_not_replaced(tmp_path):
    path = str(tmp_path / "s.sock")
    async with serve_in_background(fake_engine(), address=f"unix:{path}"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(InvalidArgument, match="already listening"):
            await open_listener(endpoint.Address("unix", path=path))


def test_addresses_parse():
    assert endpoint.parse_address("tcp:127.0.0.1:80") == endpoint.Address("tcp", host="127.0.0.1", port=80)
    assert endpoint.parse_address("tcp:[::1]:9").host == "::1"
    assert endpoint.parse_address("/a/b").path == "/a/b"
    assert str(endpoint.parse_address("unix:/a")) == "unix:/a"
    for bad in ("", "tcp:host", "tcp::80", "tcp:h:99999", "unix:"):
        with pytest.raises(InvalidArgument):
            endpoint.parse_address(bad)
