"""A throwaway OpenSSH sshd on 127.0.0.1 (or another address), for tests and demos.

It gets its own host key, an authorized_keys file holding a fresh client key,
and a client-side ssh_config + known_hosts in the same temporary directory, so
nothing touches ~/.ssh or the system sshd.

From Python::

    from sshd import Sshd          # with tests/support on sys.path
    with Sshd() as server:
        subprocess.run(["ssh", "-F", server.ssh_config, server.alias, "true"])

From a shell (the server keeps running until `stop`)::

    cfg=$(python3 tests/support/sshd.py start --dir /tmp/demo-sshd)
    tunnel up -F "$cfg" tunnel-demo --no-browser
    python3 tests/support/sshd.py stop --dir /tmp/demo-sshd

sshd runs as the invoking user (root in CI: root login is allowed with keys
only). Stopping kills sshd and every process below it (sessions, and whatever
they started), so a failed test cannot leave a Jupyter server behind.

To run it somewhere else, e.g. inside a network namespace, give the address it
listens on and a command prefix::

    Sshd(listen_host="10.213.0.2", command_prefix=["ip", "netns", "exec", "ns1"])
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PAM_DIR = Path("/etc/pam.d")
PAM_OATH = "pam_oath.so"  # from the libpam-oath package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """All processes below pid (children first found, then theirs)."""
    kids = _children()
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL pid and everything below it."""
    for p in [pid] + descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
    )


STALE_PYENV_LOCK_S = 10


def clear_stale_pyenv_lock() -> bool:
    """Removes pyenv's rehash lock where a killed rehash left it; whether it did.

    The sessions log in as the invoking user with that user's own profile.
    Where it sets up pyenv (`eval "$(pyenv init -)"` in ~/.bashrc, as on the
    CI machines), every login runs `pyenv rehash`, which holds
    $PYENV_ROOT/shims/.pyenv-shim while it writes its shims. A shell killed
    in that moment (scancel, SIGKILL: tests do both) leaves the file, and
    every later login then waits 60 s for it: one slurm test's kill made
    eight later tests time out (2026-12-07). A rehash holds it for well
    under a second, so one still there STALE_PYENV_LOCK_S after it was made
    is such a leftover (the rehashes waiting on it cannot tell, and give up
    only after 60 s). Waits for a younger one to go or to grow that old.
    """
    lock = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "shims" / ".pyenv-shim"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            return False
        if age >= STALE_PYENV_LOCK_S:
            lock.unlink(missing_ok=True)
            return True
        time.sleep(0.2)


class Sshd:
    """One sshd on listen_host:port with everything it needs in `workdir`.

    command_prefix goes before sshd's argv (it must exec sshd, so that the pid
    is sshd's own: `ip netns exec NS` does); the client side then reaches the
    server at listen_host.
    """

    def __init__(self, workdir: str | os.PathLike | None = None, alias: str = "tunnel-test",
                 user: str | None = None, extra_sshd_config: str = "",
                 totp_secret: str | None = None, listen_host: str = "127.0.0.1",
                 command_prefix: list[str] | tuple[str, ...] = ()):
        self._own_dir = workdir is None
        self.listen_host = listen_host
        self.command_prefix = list(command_prefix)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="tunnel-sshd."))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.alias = alias
        self.user = user or getpass.getuser()
        self.extra_sshd_config = extra_sshd_config
        # With a TOTP secret (hex), logins need the key AND a one-time code
        # asked through keyboard-interactive by PAM (pam_oath). sshd names its
        # PAM service after argv[0], so a symlink with a unique name gives
        # this server its own /etc/pam.d file and leaves the system's alone.
        self.totp_secret = totp_secret
        self.pam_service = f"tunnel-test-{os.getpid()}-{id(self):x}" if totp_secret else None
        self.oath_users = self.dir / "users.oath"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.host_key = self.dir / "host_ed25519"
        self.client_key = self.dir / "client_ed25519"
        self.other_key = self.dir / "stranger_ed25519"  # never authorized
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"
        self.sshd_config = self.dir / "sshd_config"
        self.log = self.dir / "sshd.log"

    # -- lifecycle ---------------------------------------------------------

    def start(self, detach: bool = False) -> "Sshd":
        clear_stale_pyenv_lock()
        try:
            os.makedirs("/run/sshd", exist_ok=True)  # privilege separation dir (root only)
        except PermissionError:
            pass
        if not self.host_key.exists():
            _keygen(self.host_key, "tunnel-test-host")
        for key in (self.client_key, self.other_key):
            if not key.exists():
                _keygen(key, "tunnel-test-client")
        (self.dir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        if self.totp_secret:
            self._write_pam()
        for attempt in range(5):
            # A free port here is as good a guess as any inside another
            # namespace; a taken one makes sshd exit and the loop retry.
            self.port = self.port or free_port()
            self._write_sshd_config()
            if self._launch(detach):
                break
            self.port = 0
        else:
            raise RuntimeError(f"sshd did not start; see {self.log}:\n{self.log.read_text()}")
        self.write_known_hosts()
        self.ssh_config.write_text(self.client_config())
        self._save_state()
        return self

    def _write_sshd_config(self) -> None:
        self.sshd_config.write_text(
            f"""ListenAddress {self.listen_host}:{self.port}
HostKey {self.host_key}
PidFile {self.dir}/sshd.pid
AuthorizedKeysFile {self.dir}/authorized_keys
StrictModes no
PermitRootLogin {self._root_login()}
PubkeyAuthentication yes
PasswordAuthentication no
{self._auth_config()}
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 50
LogLevel INFO
{self.extra_sshd_config}
"""
        )

    def _root_login(self) -> str:
        # With prohibit-password, sshd feeds PAM a bogus answer for root, so
        # a code could never pass; the key is still required
        # (AuthenticationMethods publickey,keyboard-interactive).
        return "yes" if self.totp_secret else "prohibit-password"

    def _auth_config(self) -> str:
        if not self.totp_secret:
            return "KbdInteractiveAuthentication no\nUsePAM no"
        return ("KbdInteractiveAuthentication yes\nUsePAM yes\n"
                "AuthenticationMethods publickey,keyboard-interactive")

    def _write_pam(self) -> None:
        """users.oath (pam_oath rewrites it to record used codes) and the PAM
        service file: auth by TOTP only (the key is sshd's own check)."""
        self.oath_users.write_text(f"HOTP/T30/6 {self.user} - {self.totp_secret}\n")
        os.chmod(self.oath_users, 0o600)
        (PAM_DIR / self.pam_service).write_text(
            f"auth required {PAM_OATH} usersfile={self.oath_users} window=2 digits=6\n"
            "account required pam_permit.so\n"
            "session required pam_permit.so\n"
            "password required pam_deny.so\n"
        )

    def _argv0(self) -> str:
        """sshd's argv[0]: absolute (its re-exec needs that), and named after
        the PAM service when there is one."""
        if not self.pam_service:
            return SSHD
        link = self.dir / self.pam_service
        if not link.exists():
            link.symlink_to(SSHD)
        return str(link)

    def _launch(self, detach: bool) -> bool:
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [*self.command_prefix, self._argv0(), "-D", "-e", "-f", str(self.sshd_config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=detach,
        )
        log.close()
        self.pid = self.proc.pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # e.g. the port was taken meanwhile
            try:
                with socket.create_connection((self.listen_host, self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return True
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        return False

    def stop(self) -> None:
        if self.pid:
            kill_tree(self.pid)
            if self.proc is not None:
                self.proc.wait(timeout=10)
        self.pid = None
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port (e.g. after changing the host key)."""
        self.stop()
        self.start()

    def rotate_host_key(self) -> None:
        """Give the server a new host key; the client's known_hosts keeps the old one."""
        old_known = self.known_hosts.read_text() if self.known_hosts.exists() else None
        for p in (self.host_key, Path(f"{self.host_key}.pub")):
            p.unlink(missing_ok=True)
        _keygen(self.host_key, "tunnel-test-host-new")
        self.restart()
        if old_known is not None:
            self.known_hosts.write_text(old_known)

    def cleanup(self) -> None:
        self.stop()
        if self.pam_service:
            (PAM_DIR / self.pam_service).unlink(missing_ok=True)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Sshd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- client side -------------------------------------------------------

    def host_public_key(self) -> str:
        return " ".join(Path(f"{self.host_key}.pub").read_text().split()[:2])

    def known_hosts_line(self) -> str:
        return f"[{self.listen_host}]:{self.port} {self.host_public_key()}"

    def write_known_hosts(self, known: bool = True) -> None:
        self.known_hosts.write_text(self.known_hosts_line() + "\n" if known else "")
        os.chmod(self.known_hosts, 0o600)

    def client_config(self, alias: str | None = None, **options: str) -> str:
        """ssh_config text for this server; keyword arguments override or add options."""
        opts = {
            "HostName": self.listen_host,
            "Port": str(self.port),
            "User": self.user,
            "IdentityFile": str(self.client_key),
            "IdentitiesOnly": "yes",
            "IdentityAgent": "none",
            "UserKnownHostsFile": str(self.known_hosts),
            "GlobalKnownHostsFile": "/dev/null",
            "StrictHostKeyChecking": "yes",
            "PasswordAuthentication": "no",
            "ConnectTimeout": "10",
        }
        opts.update(options)
        body = "".join(f"    {k} {v}\n" for k, v in opts.items() if v is not None)
        return f"Host {alias or self.alias}\n{body}"

    def session_pids(self) -> list[int]:
        """Processes below sshd: sessions and what they started."""
        return descendants(self.pid) if self.pid else []

    def _save_state(self) -> None:
        (self.dir / "state.json").write_text(json.dumps({
            "pid": self.pid, "port": self.port, "alias": self.alias,
            "ssh_config": str(self.ssh_config),
        }))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    start = sub.add_parser("start", help="start an sshd; print the client ssh_config path")
    start.add_argument("--dir", required=True, help="directory for keys, configs and logs")
    start.add_argument("--alias", default="tunnel-demo", help="Host alias in the ssh_config")
    stop = sub.add_parser("stop", help="stop the sshd started in --dir, and all its sessions")
    stop.add_argument("--dir", required=True)
    args = ap.parse_args(argv)

    if args.cmd == "start":
        server = Sshd(args.dir, alias=args.alias).start(detach=True)
        print(server.ssh_config)
        return 0
    state_file = Path(args.dir) / "state.json"
    if not state_file.exists():
        print(f"no sshd state in {args.dir}", file=sys.stderr)
        return 1
    pid = json.loads(state_file.read_text())["pid"]
    kill_tree(pid)
    state_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
