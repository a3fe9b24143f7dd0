import socket
import subprocess
import sys

import pytest

from megatron.bridge.utils import tcp_sockets

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's TCP table in /proc"),
]


@pytest.fixture
def connection():
    """A listening socket, and a client connected to it (both ends in this process)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    yield server, client, accepted
    for sock in (accepted, client, server):
        sock.close()


def test_the_table_lists_a_listener_and_both_ends_of_a_connection_with_their_fds(connection):
    server, client, accepted = connection
    port = server.getsockname()[1]
    rows = tcp_sockets.tcp_sockets()
    fds = tcp_sockets.socket_fds()
    listening = [r for r in rows if r.state == tcp_sockets.LISTEN and r.local_port == port]
    assert len(listening) == 1 and fds[listening[0].inode] == server.fileno()
    ends = {
        (r.local_port, r.remote_port): fds.get(r.inode)
        for r in rows
        if r.state == tcp_sockets.ESTABLISHED and port in (r.local_port, r.remote_port)
    }
    client_port = client.getsockname()[1]
    assert ends == {(client_port, port): client.fileno(), (port, client_port): accepted.fileno()}


_SHUTDOWN = """
import socket
from megatron.bridge.utils import cpu_shims

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(2)
kept = socket.create_connection(server.getsockname())
kept_peer, _ = server.accept()
cut = socket.create_connection(server.getsockname())
cut_peer, _ = server.accept()
# Keep the connection whose client end has kept's port; every other established connection is cut.
assert cpu_shims.shutdown_gloo_connections(keep_ports={kept.getsockname()[1]}) == 2
kept.sendall(b"still up")
assert kept_peer.recv(16) == b"still up"
assert cut_peer.recv(16) == b""  # the peer sees the connection end at once, as a gloo peer in a collective would
try:
    cut.sendall(b"after")
except OSError:
    pass
else:
    raise AssertionError("a cut connection still sends")
assert cut.fileno() >= 0  # the fd itself stays its owner's
print("ok")
"""


def test_gloo_shutdown_cuts_connections_but_keeps_the_ones_on_kept_ports():
    # In a fresh interpreter: the shim cuts every connection of its process but the kept ones.
    out = subprocess.run([sys.executable, "-c", _SHUTDOWN], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
