"""Logging in to a real nats-server with an nkey, and over TLS (a certificate made for the test)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fleet_bus import Bus, BusUnavailable, NatsAuth, ensure_streams
from fleet_bus.auth import redacted
from fleet_local.processes import free_port, spawn, stop_pid, wait_http
from fleet_local.servers import find_binary
from fleet_proto import NodeLeft


def start_with_config(folder: Path, config: str) -> Iterator[str]:
    port, monitor = free_port(), free_port()
    conf = folder / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\n{config}\n')
    log = folder / "nats.log"
    proc = spawn([find_binary("nats-server"), "-c", str(conf), "-js", "-sd", str(folder / "js")], log)
    try:
        wait_http(proc, "nats-server", log, f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", 20)
        yield f"127.0.0.1:{port}"
    finally:
        stop_pid(proc.pid)


@pytest.fixture
def user_seed(tmp_path: Path) -> Path:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp_path / "user.nk"
    path.write_bytes(seed)
    return path


@pytest.fixture
def nkey_server(tmp_path: Path, user_seed: Path) -> Iterator[str]:
    public = nkeys.from_seed(bytearray(user_seed.read_bytes())).public_key.decode()
    yield from start_with_config(tmp_path, f"authorization {{ users: [ {{ nkey: {public} }} ] }}")


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    cert, key = self_signed(tmp_path)
    config = (
        f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\nauthorization {{ user: fleet, password: pw }}'
    )
    for address in start_with_config(tmp_path, config):
        yield address, cert


async def published_once(bus: Bus) -> None:
    await ensure_streams(bus.js)
    assert await bus.publish_event(NodeLeft(node_id="n", reason="auth test")) >= 1


async def test_an_nkey_user_logs_in_and_no_one_else(nkey_server: str, user_seed: Path):
    url = f"nats://{nkey_server}"
    bus = await Bus.connect(url, "nkey-test", auth=NatsAuth(nkey_seed_file=str(user_seed)))
    try:
        await published_once(bus)
    finally:
        await bus.close()
    with pytest.raises(BusUnavailable):
        await Bus.connect(url, "anonymous", connect_deadline_s=2)


async def test_tls_with_the_servers_ca_and_a_password(tls_server: tuple[str, Path]):
    address, ca = tls_server
    url = f"tls://{address}"
    bus = await Bus.connect(url, "tls-test", auth=NatsAuth(user="fleet", password="pw", tls_ca_file=str(ca)))
    try:
        assert bus.nc.connected_url.scheme == "tls"
        await published_once(bus)
    finally:
        await bus.close()
    with pytest.raises(BusUnavailable):  # the system CAs do not know the test's certificate
        await Bus.connect(url, "untrusting", auth=NatsAuth(user="fleet", password="pw"), connect_deadline_s=2)


def test_logs_never_show_a_urls_credentials():
    assert redacted("nats://fleet:s3cret@127.0.0.1:4222") == "nats://***@127.0.0.1:4222"
    assert redacted("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_tls_is_on_for_tls_urls_or_a_ca():
    assert "tls" not in NatsAuth(user="u", password="p").options("nats://h:1")
    assert NatsAuth().options("tls://nats.example:4222")["tls_hostname"] == "nats.example"
    assert NatsAuth(nkey_seed_file="/s.nk").options("nats://h:1") == {"nkeys_seed": "/s.nk"}
