"""Host certificates and `@cert-authority` lines in known_hosts, against a real sshd with a
HostCertificate signed by ssh-keygen: a certificate the authority vouches for is accepted,
one it does not is refused, and --accept-new never records a plain key for a host that an
authority line covers (an impostor without the authority's signature offers exactly that)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sshd import Sshd
from tunnel_harness import EXIT, run_tunnel


def keygen(*args: str) -> None:
    subprocess.run(["ssh-keygen", "-q", *args], check=True, capture_output=True)


@pytest.fixture
def certified_sshd(tmp_path):
    """Factory: an sshd whose host key is certified for `principals` by a fresh CA (or
    not certified at all with principals=None); (server, CA public key line)."""
    servers = []

    def make(principals: str | None):
        d = tmp_path / f"sshd{len(servers)}"
        d.mkdir()
        keygen("-t", "ed25519", "-N", "", "-f", str(tmp_path / f"ca{len(servers)}"))
        ca_pub = (tmp_path / f"ca{len(servers)}.pub").read_text().split()[:2]
        host_key = d / "host_ed25519"  # the name Sshd uses; made here to be signed first
        keygen("-t", "ed25519", "-N", "", "-f", str(host_key))
        extra = ""
        if principals is not None:
            keygen("-s", str(tmp_path / f"ca{len(servers)}"), "-h", "-I", "test-host",
                   "-n", principals, f"{host_key}.pub")
            extra = f"HostCertificate {host_key}-cert.pub"
        server = Sshd(d, extra_sshd_config=extra).start()
        servers.append(server)
        return server, " ".join(ca_pub)

    yield make
    for s in servers:
        s.cleanup()


def config_with_ca(server: Sshd, ca: str, tmp_path: Path, tag: str = "",
                   **options) -> tuple[Path, Path]:
    known = tmp_path / f"known_hosts_ca_{server.port}{tag}"
    known.write_text(f"@cert-authority [{server.listen_host}]:{server.port} {ca}\n")
    os.chmod(known, 0o600)
    config = tmp_path / f"ssh_config_ca_{server.port}{tag}"
    config.write_text(server.client_config(UserKnownHostsFile=str(known), **options))
    return config, known


def up(tunnel_bin, state_dir, config, alias, *args):
    # A bogus --env: it fails after the host key and the login, at the remote setup.
    return run_tunnel(tunnel_bin, state_dir, "-v", "up", "-F", str(config), alias,
                      "--no-browser", "--env", "/nonexistent-env", *args, timeout=90)


def ssh_true(config, alias, *opts):
    return subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", *opts, alias, "true"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_a_certificate_the_authority_signed_is_accepted(certified_sshd, tmp_path, tunnel_bin,
                                                        state_dir):
    server, ca = certified_sshd("127.0.0.1")
    config, known = config_with_ca(server, ca, tmp_path)
    assert ssh_true(config, server.alias).returncode == 0
    r = up(tunnel_bin, state_dir, config, server.alias)
    # Past the host key and the login: only the bogus --env failed.
    assert r.returncode == EXIT["remote_setup"], r.stderr
    assert "host certificate" in r.stderr and "signed by the authority at" in r.stderr
    assert known.read_text().count("\n") == 1  # nothing recorded


def test_a_certificate_for_another_host_is_refused(certified_sshd, tmp_path, tunnel_bin,
                                                   state_dir):
    server, ca = certified_sshd("other.example")
    config, known = config_with_ca(server, ca, tmp_path)
    assert ssh_true(config, server.alias).returncode == 255
    for extra in ((), ("--accept-new",)):
        r = up(tunnel_bin, state_dir, config, server.alias, *extra)
        assert r.returncode == EXIT["host_key_unknown"], r.stderr
        assert "presented a host certificate that known_hosts does not vouch for: it is for " \
               "other.example, not 127.0.0.1" in r.stderr, r.stderr
        assert f"({known}:1)" in r.stderr
    assert known.read_text().count("\n") == 1


def test_a_certificate_from_another_authority_is_refused(certified_sshd, tmp_path, tunnel_bin,
                                                         state_dir):
    server, _ = certified_sshd("127.0.0.1")
    _, other_ca = certified_sshd("127.0.0.1")
    config, _ = config_with_ca(server, other_ca, tmp_path)
    r = up(tunnel_bin, state_dir, config, server.alias)
    assert r.returncode == EXIT["host_key_unknown"], r.stderr
    assert "which no @cert-authority line for this host names" in r.stderr


def test_accept_new_does_not_record_a_plain_key_for_a_certified_host(
    certified_sshd, tmp_path, tunnel_bin, state_dir
):
    server, ca = certified_sshd(None)  # the server has no certificate: a plain key only
    config, known = config_with_ca(server, ca, tmp_path)
    before = known.read_text()
    r = up(tunnel_bin, state_dir, config, server.alias, "--accept-new")
    assert r.returncode == EXIT["host_key_unknown"], r.stderr
    assert f"but {known}:1 says its keys are certified by an authority" in r.stderr, r.stderr
    assert f"@cert-authority [127.0.0.1]:{server.port}" in r.stderr  # the line itself
    assert "is not recorded on first use" in r.stderr
    assert known.read_text() == before
    # The same through the config's StrictHostKeyChecking accept-new.
    config2, known2 = config_with_ca(server, ca, tmp_path, "-2",
                                     StrictHostKeyChecking="accept-new")
    r = up(tunnel_bin, state_dir, config2, server.alias)
    assert r.returncode == EXIT["host_key_unknown"], r.stderr
    assert known2.read_text() == before
    # Without the authority line, --accept-new records the key as before.
    known.write_text("")
    r = up(tunnel_bin, state_dir, config, server.alias, "--accept-new")
    assert r.returncode == EXIT["remote_setup"], r.stderr
    assert server.host_public_key() in known.read_text()
