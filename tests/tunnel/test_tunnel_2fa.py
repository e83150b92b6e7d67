"""Keyboard-interactive 2FA (a real sshd requiring publickey + a TOTP code through
PAM/pam_oath) and encrypted keys, answered on a terminal (a pty)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import signal
import subprocess
import termios
import time
from pathlib import Path

import pytest

from sshd import PAM_DIR, Sshd
from test_tunnel_reconnect import kill_ssh_sessions
from tunnel_harness import EXIT, tunnel_env

SECRET = "3132333435363738393031323334353637383930"  # hex, as pam_oath's users file has it
OTP_PROMPT = b"One-time password"
PASSPHRASE = "correct horse battery"


def pam_oath_present() -> bool:
    return any(Path(d, "security", "pam_oath.so").exists()
               for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
                         "/usr/lib64", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu"))


needs_pam_oath = pytest.mark.skipif(
    os.geteuid() != 0 or not pam_oath_present() or shutil.which("oathtool") is None
    or not os.access(PAM_DIR, os.W_OK),
    reason="needs root, libpam-oath and oathtool (apt-get install -y libpam-oath oathtool)",
)


def totp() -> str:
    return subprocess.run(["oathtool", "--totp", "-d", "6", SECRET], check=True,
                          capture_output=True, text=True).stdout.strip()


def wrong_code() -> str:
    right = totp()
    return "000000" if right != "000000" else "111111"


@pytest.fixture
def totp_sshd(tmp_path):
    with Sshd(tmp_path / "sshd-2fa", totp_secret=SECRET) as server:
        yield server


@pytest.fixture
def encrypted_key(sshd, tmp_path):
    """The authorized client key, encrypted with PASSPHRASE."""
    key = tmp_path / "encrypted_ed25519"
    shutil.copy(sshd.client_key, key)
    os.chmod(key, 0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", PASSPHRASE, "-f", str(key)],
                   check=True, capture_output=True)
    return key


def _own_terminal() -> None:
    """In the child: a new session whose controlling terminal is stdin (the pty)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class OnPty:
    """`tunnel` with stdin and stderr on a pty (as at a terminal), stdout piped."""

    def __init__(self, tunnel_bin, state_dir, argv):
        self.master, slave = pty.openpty()
        # The pty must be the controlling terminal: hidden prompts (rpassword,
        # as ssh) read /dev/tty, not stdin.
        self.proc = subprocess.Popen([str(tunnel_bin), *argv], stdin=slave, stderr=slave,
                                     stdout=subprocess.PIPE, env=tunnel_env(state_dir),
                                     preexec_fn=_own_terminal)
        os.close(slave)
        self.seen = b""

    def read_until(self, needle: bytes, timeout: float = 30, start: int = 0) -> int:
        """Read the terminal until `needle` appears after offset `start`; its offset."""
        deadline = time.monotonic() + timeout
        while needle not in self.seen[start:]:
            assert time.monotonic() < deadline, self.text()
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the process exited and closed the terminal
                    break
            elif self.proc.poll() is not None:
                break
        assert needle in self.seen[start:], self.text()
        return self.seen.index(needle, start)

    def answer(self, text: str) -> None:
        os.write(self.master, text.encode() + b"\n")

    def drain_until_exit(self, timeout: float = 40) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:
                    break
        return self.proc.wait(timeout=5)

    def text(self) -> str:
        return self.seen.decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def up_argv(server, config, jupyter_prefix, *extra):
    return ["-v", "up", "-F", str(config), server.alias, "--no-browser", "--app", "server",
            "--env", str(jupyter_prefix), *extra]


@needs_pam_oath
def test_right_totp_code_lets_in(totp_sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(totp_sshd.client_config())
    t = OnPty(tunnel_bin, state_dir, up_argv(totp_sshd, config, jupyter_prefix))
    try:
        t.read_until(OTP_PROMPT)
        assert f"for `{totp_sshd.user}'".encode() in t.seen  # the server's own prompt text
        code = totp()
        t.answer(code)
        url = t.proc.stdout.readline().decode().strip()
        assert "token=" in url, t.text()
        assert code.encode() not in t.seen, "the code was echoed"
        t.proc.send_signal(signal.SIGINT)
        assert t.drain_until_exit() == EXIT["ok"], t.text()
    finally:
        t.close()
    # The key alone was not enough: the code was the second factor.
    assert "partial success; the server asks for more" in t.text()
    assert "Accepted keyboard-interactive/pam" in totp_sshd.log.read_text()


@needs_pam_oath
def test_wrong_totp_code_is_refused(totp_sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(totp_sshd.client_config())
    t = OnPty(tunnel_bin, state_dir, up_argv(totp_sshd, config, jupyter_prefix))
    try:
        at = 0
        for _ in range(3):  # asked again after each refusal, then it gives up
            at = t.read_until(OTP_PROMPT, start=at) + 1
            t.answer(wrong_code())
        rc = t.drain_until_exit()
        assert t.proc.stdout.read() == b"", "no URL after a refused code"
    finally:
        t.close()
    out = t.text()
    assert rc == EXIT["auth"], out
    assert "Permission denied, please try again." in out
    assert f"permission denied for {totp_sshd.user}@127.0.0.1" in out
    assert "keyboard-interactive (the server refused the answers 3 time(s))" in out
    assert "Accepted keyboard-interactive" not in totp_sshd.log.read_text()


@needs_pam_oath
def test_doctor_without_a_terminal_names_auth_and_keyboard_interactive(totp_sshd, state_dir,
                                                                        tunnel_bin, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(totp_sshd.client_config())
    r = subprocess.run([str(tunnel_bin), "doctor", "-F", str(config), totp_sshd.alias],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                       env=tunnel_env(state_dir))
    assert r.returncode == EXIT["auth"], r.stdout + r.stderr
    assert "FAIL  auth" in r.stdout
    assert "keyboard-interactive (not asked: no terminal" in r.stdout


def test_encrypted_key_asked_once_and_reused_on_reconnect(sshd, encrypted_key, state_dir,
                                                          tunnel_bin, jupyter_prefix, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config(IdentityFile=str(encrypted_key)))
    t = OnPty(tunnel_bin, state_dir, up_argv(sshd, config, jupyter_prefix, "--linger", "30"))
    try:
        t.read_until(b"Enter passphrase for key")
        t.answer(PASSPHRASE)
        url = t.proc.stdout.readline().decode().strip()
        assert "token=" in url, t.text()
        assert PASSPHRASE.encode() not in t.seen, "the passphrase was echoed"
        kill_ssh_sessions(sshd)
        t.read_until(b"reconnected to", timeout=15)
        assert t.seen.count(b"Enter passphrase for key") == 1, t.text()
        t.proc.send_signal(signal.SIGINT)
        assert t.drain_until_exit() == EXIT["ok"], t.text()
    finally:
        t.close()


@needs_pam_oath
def test_keyboard_interactive_text_cannot_send_terminal_controls(
    totp_sshd, state_dir, tunnel_bin, jupyter_prefix, tmp_path
):
    """A PAM message (pam_echo) reaches the client inside the keyboard-interactive prompt:
    its escape sequences (set the window title, clear the screen) are shown escaped."""
    message = tmp_path / "pam-message"
    message.write_bytes(b"\x1b]0;pwned\x07\x1b[2JWelcome to gpu01")
    service = PAM_DIR / totp_sshd.pam_service
    service.write_text(f"auth optional pam_echo.so file={message}\n" + service.read_text())
    config = tmp_path / "ssh_config"
    config.write_text(totp_sshd.client_config())
    t = OnPty(tunnel_bin, state_dir, up_argv(totp_sshd, config, jupyter_prefix))
    try:
        t.read_until(OTP_PROMPT)
        assert b"\\033]0;pwned\\007\\033[2JWelcome to gpu01" in t.seen, t.text()
        assert b"\x1b" not in t.seen and b"\x07" not in t.seen, t.text()
        t.answer(totp())
        url = t.proc.stdout.readline().decode().strip()
        assert "token=" in url, t.text()
        t.proc.send_signal(signal.SIGINT)
        assert t.drain_until_exit() == EXIT["ok"], t.text()
    finally:
        t.close()
