"""Helpers for driving the real `tunnel` binary and inspecting what it did."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

REPO = Path(__file__).resolve().parents[2]

# Exit codes documented in `tunnel --help` (crates/tunnel/src/exit.rs).
EXIT = {
    "ok": 0,
    "config": 3,
    "unknown_alias": 4,
    "dns": 5,
    "refused": 6,
    "timeout": 7,
    "auth": 8,
    "host_key_changed": 9,
    "host_key_unknown": 10,
    "jupyter_missing": 11,
    "jupyter_failed": 12,
    "port_busy": 13,
    "connection_lost": 14,
    "no_tunnel": 15,
    "already_running": 16,
    "remote_setup": 17,
}


def find_tunnel_binary() -> Path:
    """$TUNNEL_BIN, else $CARGO_TARGET_DIR/{release,debug}/tunnel, else target/..."""
    explicit = os.environ.get("TUNNEL_BIN")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise RuntimeError(f"TUNNEL_BIN={explicit} does not exist")
        return path
    roots = []
    if os.environ.get("CARGO_TARGET_DIR"):
        roots.append(Path(os.environ["CARGO_TARGET_DIR"]))
    roots.append(REPO / "target")
    for root in roots:
        for profile in ("release", "debug"):
            candidate = root / profile / "tunnel"
            if candidate.is_file():
                return candidate
    raise RuntimeError("tunnel is not built: cargo build -p tunnel, or set TUNNEL_BIN")


def jupyter_env() -> Path:
    """The venv running these tests must be the one with Jupyter in it."""
    for prefix in (Path(sys.prefix), REPO / ".venv"):
        if (prefix / "bin" / "jupyter-lab").exists():
            return prefix
    raise RuntimeError("run the tests with the project venv (it has jupyter) active")


class Tunnel:
    """One `tunnel up` process, with stdout/stderr collected in the background."""

    def __init__(self, binary, sshd, state_dir, jupyter_prefix, args, env=None, config=None,
                 host=None):
        self.sshd = sshd
        self.state_dir = Path(state_dir)
        self.env = tunnel_env(state_dir, env)
        self.args = list(args)
        cmd = [str(binary), "-v", "up", "-F", str(config or sshd.ssh_config)]
        if not any(a == "--env" for a in self.args):
            cmd += ["--env", str(jupyter_prefix)]
        if "--browser" in self.args:
            self.args.remove("--browser")
        else:
            cmd.append("--no-browser")
        cmd.append(host or sshd.alias)
        cmd += self.args
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=self.env,
        )
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._got_line = threading.Event()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout_lines, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream, sink, signal_line):
        for raw in iter(stream.readline, b""):
            sink.append(raw.decode(errors="replace").rstrip("\n"))
            if signal_line:
                self._got_line.set()
        stream.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    @property
    def stdout(self) -> str:
        return "\n".join(self.stdout_lines)

    def wait_url(self, timeout: float = 60) -> str:
        """The URL line; fails with tunnel's stderr if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._got_line.wait(0.1):
                return self.stdout_lines[0]
            if self.proc.poll() is not None:
                self._join()
                if self.stdout_lines:
                    return self.stdout_lines[0]
                raise AssertionError(
                    f"tunnel exited {self.proc.returncode} without a URL:\n{self.stderr}"
                )
        raise AssertionError(f"no URL after {timeout}s:\n{self.stderr}")

    def wait(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._join()
        return rc

    def _join(self):
        for t in self._threads:
            t.join(timeout=5)

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def interrupt_and_wait(self, timeout: float = 40) -> int:
        self.signal(signal.SIGINT)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._join()


def tunnel_env(state_dir, extra=None) -> dict:
    env = dict(os.environ)
    env.pop("SSH_AUTH_SOCK", None)
    env["TUNNEL_STATE_DIR"] = str(state_dir)
    env.update(extra or {})
    return env


def run_tunnel(binary, state_dir, *args, timeout=60, env=None) -> subprocess.CompletedProcess:
    """Run a short-lived tunnel command (down/status/ls, or an `up` expected to fail)."""
    return subprocess.run(
        [str(binary), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout, env=tunnel_env(state_dir, env),
    )


@contextlib.contextmanager
def ssh_agent(sock: Path, keys):
    """A real ssh-agent listening on `sock` and holding `keys`, stopped on exit."""
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(sock.exists, timeout=5, interval=0.05)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        for key in keys:
            subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def token_of(url: str) -> str:
    return parse_qs(urlparse(url).query)["token"][0]


def port_of(url: str) -> int:
    return urlparse(url).port


# -- processes -------------------------------------------------------------------


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"
    except OSError:
        return False


def processes_of_runtime_dir(runtime_dir: str) -> list[int]:
    """Jupyter and its kernels: they carry JUPYTER_RUNTIME_DIR=<dir> in their environment,
    and kernels name their connection file (inside it) on their command line."""
    needle_env = f"JUPYTER_RUNTIME_DIR={runtime_dir}".encode()
    out = []
    for pid in all_pids():
        if pid == os.getpid() or not alive(pid):
            continue
        if needle_env in environ(pid).split(b"\0") or runtime_dir.encode() + b"/" in cmdline(pid):
            out.append(pid)
    return out


def kernel_pids(runtime_dir: str) -> list[int]:
    return [p for p in processes_of_runtime_dir(runtime_dir) if b"kernel-" in cmdline(p)]


def wait_until(pred, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


# -- sockets ---------------------------------------------------------------------


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(int(m.group(1)))
    return inodes


def _decode_addr(hexaddr: str) -> tuple[str, int]:
    ip_hex, port_hex = hexaddr.split(":")
    port = int(port_hex, 16)
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1]), port
    # IPv6: four little-endian 32-bit words.
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    full = b"".join(words)
    import ipaddress
    return str(ipaddress.IPv6Address(full)), port


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets `pid` listens on, from /proc/net/tcp{,6}."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, st, inode = fields[1], fields[3], int(fields[9])
                if st == "0A" and inode in inodes:  # 0A = LISTEN
                    out.append(_decode_addr(local))
    return out


def established_to(port: int, pids) -> bool:
    """Whether one of pids holds an established TCP connection to 127.0.0.1:port."""
    inodes = set()
    for p in pids:
        inodes |= _socket_inodes(p)
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            remote, st, inode = fields[2], fields[3], int(fields[9])
            if st == "01" and inode in inodes and int(remote.split(":")[1], 16) == port:
                return True
    return False


def is_loopback(addr: str) -> bool:
    import ipaddress
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# -- secrets ---------------------------------------------------------------------


def cmdlines_containing(secret: str) -> list[tuple[int, str]]:
    needle = secret.encode()
    return [
        (pid, cmdline(pid).replace(b"\0", b" ").decode(errors="replace"))
        for pid in all_pids()
        if needle in cmdline(pid)
    ]


def files_containing(secret: str, roots) -> list[tuple[Path, int]]:
    """(path, permission bits) of regular files under roots whose content holds secret."""
    needle = secret.encode()
    hits = []
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                p = Path(dirpath) / name
                try:
                    st = p.lstat()
                    if not stat.S_ISREG(st.st_mode) or st.st_size > 8 * 1024 * 1024:
                        continue
                    if needle in p.read_bytes():
                        hits.append((p, stat.S_IMODE(st.st_mode)))
                except OSError:
                    continue
    return hits
