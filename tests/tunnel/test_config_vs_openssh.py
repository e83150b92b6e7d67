"""Differential test: `tunnel config --json` against OpenSSH's own `ssh -G`.

A seeded generator writes a corpus of ssh configs (Host patterns with wildcards and
negation, Match with every criterion tunnel supports, Include inside and outside blocks,
% tokens and ${ENV}, the same options set in different places and orders) and a handful of
hand-written ones (the Match case of issue #15 first). For each config and each of several
host arguments, both programs resolve the host and fourteen options are compared one by
one; there must be no difference.

Where ssh's printout is not what ssh itself will use, ssh is asked in another way:
`ssh -G` prints IdentityFile before expanding it (ssh expands it only when it loads the
keys), so the identity files are those `ssh -v` says it loads (with ProxyCommand=true, so
nothing is dialled); GlobalKnownHostsFile is printed before its `~` is expanded, so `~` is
expanded here (it takes no other expansion).

Three values are tunnel's own by design and are not ssh's; they are the only exceptions
allowed, each exactly as described in PRODUCT_CHOICES (crates/tunnel/src/connect.rs and
config/show.rs document them). Every other difference fails the test.
"""

from __future__ import annotations

import json
import os
import pwd
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SEED = 20260415
GENERATED = 140

COMPARED = [
    "hostname", "user", "port", "identityfile", "identitiesonly", "identityagent", "proxyjump",
    "stricthostkeychecking", "userknownhostsfile", "globalknownhostsfile", "hostkeyalias",
    "serveraliveinterval", "serveralivecountmax", "connecttimeout",
]

# (option, what ssh says) -> what tunnel uses instead, and why.
PRODUCT_CHOICES = {
    ("connecttimeout", "none"): (20, "no ConnectTimeout: tunnel gives up after 20 s, ssh waits "
                                     "for the kernel's TCP timeout (connect.rs)"),
    ("connecttimeout", "0"): (20, "ConnectTimeout 0 means no timeout to ssh; tunnel uses its "
                                  "20 s (connect.rs)"),
    ("serveraliveinterval", "0"): (4, "no ServerAliveInterval: tunnel probes an idle link every "
                                      "4 s to notice a dead one (connect.rs, README)"),
    ("serveralivecountmax", "0"): (1, "russh cannot disconnect at the first silent interval as "
                                      "ssh does with 0; tunnel gives up after one unanswered "
                                      "probe"),
}

ENV_KEYDIR = "/keys-from-env"
ENV_AGENT = "/run/agent-from-env.sock"

# -- the corpus ------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    main: str
    hosts: list[str]
    # Files written under the test's $HOME/.ssh (relative Includes) or its conf.d/ (absolute).
    ssh_dir_files: dict[str, str] = field(default_factory=dict)
    confd_files: dict[str, str] = field(default_factory=dict)
    features: set[str] = field(default_factory=set)


CONFD = "@CONFD@"  # replaced by the absolute conf.d path when written

HOSTS = ["lab-1", "lab-2", "LAB-1", "gpu", "gpu.prod", "web01", "db.prod", "bastion",
         "bob@lab-1", "root@gpu", "x.example.org", "node7"]

HOSTNAMES = ["10.0.0.5", "%h.example.org", "real-%h", "Upper.Example.COM", "127.1",
             "%h", "lab-1", "gpu.internal", "100%%.example"]
USERS = ["bob", "alice", "carol", "root", "Bob"]
PORTS = ["22", "2222", "2200", "ssh", "+22"]
IDENTITY_FILES = ["~/.ssh/id_%h", "%d/.ssh/%r@%h", "~/keys/%C", "/keys/%n-%p",
                  "${TUNNEL_DIFF_KEYDIR}/k_%u", "%d/%L-%l-%i-%k", "none", "~/.ssh/id_ed25519",
                  "~/.ssh/100%%-%h", "~root/.ssh/other", "\"~/.ssh/with space\"", "~"]
AGENTS = ["none", "SSH_AUTH_SOCK", "~/.ssh/agent.%h", "$TUNNEL_DIFF_AGENT",
          "${TUNNEL_DIFF_KEYDIR}/agent-%r", "/tmp/agent.%C"]
JUMPS = ["bastion", "alice@bastion:2222", "ssh://bob@jump.example:2022", "10.1.1.1", "j1,j2:2022",
         "none", "[fe80::1]:22", "j1,alice@j2,j3", "jump.example:ssh"]
STRICT = ["yes", "no", "ask", "accept-new", "off", "true", "false", "Yes"]
USER_KH = ["/dev/null", "~/.ssh/kh_%h", "%d/kh %d/kh2", "none", "${TUNNEL_DIFF_KEYDIR}/kh_%C",
           "~/.ssh/known_hosts", "/kh/%r@%h:%p"]
GLOBAL_KH = ["/etc/ssh/other", "~/gkh", "none", "/g1 /g2", "~/.ssh/g_%h"]
ALIASES = ["Key-Alias", "lab-key", "k%h"]
INTERVALS = ["0", "15", "1m", "none", "30", "1h2m3s"]
COUNTS = ["0", "1", "3", "5"]
TIMEOUTS = ["0", "5", "1m30s", "none", "10"]

HOST_PATTERNS = ["lab-*", "lab-?", "*", "gpu", "!lab-2 lab-*", "*.prod", "web0?", "db.*",
                 "!*.prod *", "gpu gpu.*", "LAB-1", "node*", "bastion j1", "!gpu", "10.0.0.*",
                 "*.example.org x.*"]
MATCH_LISTS = ["lab-1", "lab-1,gpu", "!lab-1,lab-*", "*.prod", "10.0.0.*", "*.example.org",
               "real-*", "gpu*", "LAB-*", "*", "!gpu,*"]
USER_LISTS = ["bob", "root", "alice,carol", "b*", "!root,*", "Bob"]


def option_line(rng: random.Random, features: set[str]) -> str:
    key = rng.choice([
        "HostName", "User", "Port", "IdentityFile", "IdentityFile", "IdentitiesOnly",
        "IdentityAgent", "ProxyJump", "StrictHostKeyChecking", "UserKnownHostsFile",
        "GlobalKnownHostsFile", "HostKeyAlias", "ServerAliveInterval", "ServerAliveCountMax",
        "ConnectTimeout",
    ])
    value = {
        "HostName": HOSTNAMES, "User": USERS, "Port": PORTS, "IdentityFile": IDENTITY_FILES,
        "IdentitiesOnly": ["yes", "no", "true", "False"], "IdentityAgent": AGENTS,
        "ProxyJump": JUMPS, "StrictHostKeyChecking": STRICT, "UserKnownHostsFile": USER_KH,
        "GlobalKnownHostsFile": GLOBAL_KH, "HostKeyAlias": ALIASES,
        "ServerAliveInterval": INTERVALS, "ServerAliveCountMax": COUNTS,
        "ConnectTimeout": TIMEOUTS,
    }[key]
    v = rng.choice(value)
    features.add(f"option:{key.lower()}")
    if "%" in v:
        features.add("tokens")
    if "${" in v:
        features.add("env")
    # Keyword spelling and separators vary as they do in real configs.
    spelled = rng.choice([key, key.lower(), key.upper()])
    sep = rng.choice([" ", " ", "=", " = ", "\t"])
    return f"    {spelled}{sep}{v}"


def criterion(rng: random.Random, features: set[str]) -> str:
    kind = rng.choice(["host", "originalhost", "user", "localuser", "exec", "final", "canonical",
                       "host", "exec"])
    neg = "!" if rng.random() < 0.25 else ""
    features.add(f"match:{kind}")
    if neg:
        features.add("match:negated")
    if kind in ("host", "originalhost"):
        return f"{neg}{kind} {rng.choice(MATCH_LISTS)}"
    if kind == "user":
        return f"{neg}user {rng.choice(USER_LISTS)}"
    if kind == "localuser":
        return f"{neg}localuser {rng.choice(['root', 'nobody', 'r*', '!root,*'])}"
    if kind == "exec":
        features.add("tokens")
        cmd = rng.choice([
            "test %h = lab-1", "true", "false", "test -n '%r'", "test %p = 2222",
            "[ %u = root ]", "test %n = gpu", "test %k = lab-key", "test %L = $(hostname -s)",
            "test %l = $(hostname)", "test %d = $HOME_OF_USER", "test %i = 0",
            "test %C != x", "case %h in *.prod) exit 0;; esac; exit 1", "test %r = bob",
        ])
        return f'{neg}exec "{cmd}"'
    return f"{neg}{kind}"


def match_line(rng: random.Random, features: set[str]) -> str:
    r = rng.random()
    if r < 0.08:
        features.add("match:all")
        return rng.choice(["Match all", "Match canonical all", "Match final all", "Match !all"])
    n = rng.choice([1, 1, 2, 3])
    if n > 1:
        features.add("match:several")
    crits = [criterion(rng, features) for _ in range(n)]
    sep = rng.choice([" ", " "])
    return "Match " + sep.join(crits)


def block(rng: random.Random, features: set[str], include_targets: list[str]) -> list[str]:
    lines = []
    r = rng.random()
    if r < 0.45:
        pats = rng.choice(HOST_PATTERNS)
        features.add("host")
        if "!" in pats:
            features.add("host:negated")
        if "*" in pats or "?" in pats:
            features.add("host:wildcard")
        lines.append(f"Host {pats}")
    else:
        lines.append(match_line(rng, features))
    for _ in range(rng.randint(1, 4)):
        lines.append(option_line(rng, features))
    if include_targets and rng.random() < 0.25:
        lines.append(f"    Include {include_targets.pop()}")
        features.add("include:conditional")
    return lines


def generated_case(i: int) -> Case:
    rng = random.Random(SEED * 1000 + i)
    features: set[str] = set()
    ssh_dir_files: dict[str, str] = {}
    confd_files: dict[str, str] = {}
    include_targets: list[str] = []
    # Some configs include files: relative (in ~/.ssh), ~/ with a glob, absolute with a glob.
    if rng.random() < 0.4:
        style = rng.choice(["relative", "tilde-glob", "absolute-glob"])
        features.add(f"include:{style}")
        inc_lines = []
        if rng.random() < 0.5:
            inc_lines.append(option_line(rng, features))  # before any Host: inherits the state
        for _ in range(rng.randint(1, 2)):
            inc_lines += block(rng, features, [])
        text = "\n".join(inc_lines) + "\n"
        if style == "relative":
            ssh_dir_files[f"inc-{i}.conf"] = text
            include_targets.append(f"inc-{i}.conf")
        elif style == "tilde-glob":
            ssh_dir_files[f"inc-{i}-a.conf"] = text
            ssh_dir_files[f"inc-{i}-b.conf"] = "\n".join(block(rng, features, [])) + "\n"
            include_targets.append(f"~/.ssh/inc-{i}-*.conf")
        else:
            confd_files[f"{i}-1.conf"] = text
            confd_files[f"{i}-0.conf"] = "\n".join(block(rng, features, [])) + "\n"
            confd_files[f"{i}-x.txt"] = "Port 1\n"  # not matched by the glob
            include_targets.append(f"{CONFD}/{i}-*.conf")
    lines: list[str] = []
    if rng.random() < 0.3:
        lines.append(option_line(rng, features).strip())  # top-level, applies to all
        features.add("toplevel")
    if rng.random() < 0.15:
        lines.append(rng.choice(["CanonicalizeHostname yes", "CanonicalizeHostname always"]))
        lines.append("CanonicalDomains corp.invalid lab.invalid")
        if rng.random() < 0.3:
            lines.append("CanonicalizeMaxDots 0")
        features.add("canonicalize")
    for _ in range(rng.randint(2, 6)):
        lines += block(rng, features, include_targets)
    if include_targets:  # not placed inside a block: include at top level, after the blocks
        lines.append(f"Include {include_targets.pop()}")
        features.add("include:toplevel")
    if rng.random() < 0.2:
        lines.insert(rng.randrange(len(lines) + 1), "# a comment")
        lines.insert(rng.randrange(len(lines) + 1), "")
    hosts = rng.sample(HOSTS, 5)
    return Case(f"gen-{i:03d}", "\n".join(lines) + "\n", hosts, ssh_dir_files, confd_files,
                features)


def hand_written() -> list[Case]:
    return [
        # Issue #15: the Match must not turn host-key checking off for lab-2.
        Case("issue-15-match", "Host lab-*\n    User labuser\nMatch host lab-1\n"
             "    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n",
             ["lab-1", "lab-2", "lab-10", "LAB-1"], features={"match:host", "host:wildcard"}),
        # Match host compares the HostName; originalhost the name typed.
        Case("match-host-after-hostname", "Host lab-*\n  HostName 10.0.0.9\nMatch host lab-1\n"
             "  Port 1\nMatch originalhost lab-1\n  User orig\nMatch host 10.0.0.*\n"
             "  IdentitiesOnly yes\n", ["lab-1", "lab-2"],
             features={"match:host", "match:originalhost"}),
        # Match final: a second pass in which Host patterns see the HostName.
        Case("match-final-second-pass", "Host foo\n  HostName Bar\nMatch final host bar\n"
             "  User fin\nHost bar\n  Port 99\nMatch !final\n  IdentityFile ~/first\n",
             ["foo", "bar", "FOO"], features={"match:final"}),
        # Canonicalization on (nothing resolves: .invalid) still re-reads the config.
        Case("canonical-pass", "CanonicalizeHostname yes\nCanonicalDomains a.invalid\n"
             "Match canonical\n  User canon\nMatch !canonical host gpu\n  Port 2\n",
             ["gpu", "web01", "x.y.z"], features={"match:canonical", "canonicalize"}),
        # Conflicting values: the first one obtained wins, whatever block it is in.
        Case("first-value-wins", "Host *\n  ConnectTimeout none\nHost gpu\n  ConnectTimeout 7\n"
             "  User first\nHost *\n  User second\n  ServerAliveInterval none\n"
             "  ServerAliveInterval 9\n  IdentityFile ~/a\nHost gpu\n  IdentityFile ~/b\n"
             "  IdentityFile ~/a\n", ["gpu", "web01"], features={"host"}),
        # Include in an inactive block is read but nothing in it applies, not even its Hosts.
        Case("include-scoping", "Host a\n  Include inc-scope.conf\nHost b\n  User b-user\n",
             ["a", "b", "other"], ssh_dir_files={"inc-scope.conf": "Port 7\nHost other\n  User o\n"},
             features={"include:conditional"}),
        # IgnoreUnknown lets an unknown option through, as ssh.
        Case("ignore-unknown", "IgnoreUnknown UseFoo*,Bar\nHost *\n  UseFooBar yes\n  Port 2022\n",
             ["gpu"], features=set()),
        # ProxyJump and ProxyCommand compete: the first wins.
        Case("jump-first", "Host j\n  ProxyJump b1,alice@b2:2202\n  ProxyCommand none\n"
             "Host *\n  ProxyJump other\n", ["j", "x"], features={"option:proxyjump"}),
        # Quoting, = separators, comments, tabs.
        Case("syntax", 'Host="gpu"\n\tHostName = "real gpu"\n  Port=2222 # comment\n'
             '  IdentityFile "~/.ssh/my key"\n  User\t"bob"\n', ["gpu"], features=set()),
        # Errors: ssh refuses these configs, so must tunnel.
        Case("error-bad-port", "Host gpu\n  Port 0\n", ["gpu"]),
        Case("error-unknown-option", "Host other\n  NoSuchOption yes\n", ["gpu"]),
        Case("error-hostname-token", "Host gpu\n  HostName %d.example\n", ["gpu"]),
        Case("error-match-all-combined", "Match all host gpu\n  Port 2\n", ["gpu"]),
        Case("error-match-unknown-criterion", "Match nosuch x\n  Port 2\n", ["gpu"]),
        Case("error-unset-env", "Host gpu\n  UserKnownHostsFile ${TUNNEL_DIFF_UNSET}/kh\n",
             ["gpu", "other"]),
        Case("error-identityfile-env", "Host gpu\n  IdentityFile ~/${TUNNEL_DIFF_UNSET}\n",
             ["gpu", "other"]),
        Case("error-fallback-local", "CanonicalizeHostname yes\nCanonicalDomains a.invalid\n"
             "CanonicalizeFallbackLocal no\n", ["gpu", "a.b.c"]),
        Case("error-include-loop", "Include loop.conf\n", ["gpu"],
             ssh_dir_files={"loop.conf": "Include loop.conf\n"}),
    ]


CORPUS = hand_written() + [generated_case(i) for i in range(GENERATED)]

# -- running both ----------------------------------------------------------------------------


def _home_of(user: str) -> str:
    return pwd.getpwnam(user).pw_dir


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env.update({
        "HOME": str(home),  # glob(3)'s ~ in Include; ~ elsewhere is the passwd home, as in ssh
        "SHELL": "/bin/sh",
        "TUNNEL_DIFF_KEYDIR": ENV_KEYDIR,
        "TUNNEL_DIFF_AGENT": ENV_AGENT,
        "HOME_OF_USER": _home_of(pwd.getpwuid(os.getuid()).pw_name),
    })
    env.pop("TUNNEL_DIFF_UNSET", None)
    env.pop("SSH_AUTH_SOCK", None)
    return env


def expand_tilde(path: str) -> str:
    """What ssh's tilde_expand_filename does to GlobalKnownHostsFile entries."""
    if not path.startswith("~"):
        return path
    rest = path[1:]
    user, _, tail = rest.partition("/")
    home = _home_of(user) if user else pwd.getpwuid(os.getuid()).pw_dir
    return home.rstrip("/") + "/" + tail.lstrip("/")


def ssh_view(config: Path, host: str, env: dict) -> dict | None:
    """ssh's resolution in tunnel config's JSON shape, or None if ssh refuses it."""
    g = subprocess.run(["ssh", "-G", "-F", str(config), host], capture_output=True, text=True,
                       env=env, stdin=subprocess.DEVNULL, timeout=30)
    if g.returncode != 0:
        return None
    out: dict = {}
    for line in g.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("identityfile",):
            continue
        out[key] = value
    view: dict = {}
    for key in COMPARED:
        if key == "identityfile" or key not in out:
            continue
        value = out[key]
        if key in ("port", "serveraliveinterval", "serveralivecountmax"):
            view[key] = int(value)
        elif key == "connecttimeout":
            view[key] = value if value == "none" else int(value)
        elif key == "userknownhostsfile":
            view[key] = [] if value == "none" else value.split(" ")
        elif key == "globalknownhostsfile":
            view[key] = [] if value == "none" else [expand_tilde(p) for p in value.split(" ")]
        else:
            view[key] = value
    # The identity files ssh really loads: ask ssh itself, with nothing dialled.
    v = subprocess.run(["ssh", "-v", "-F", str(config), "-o", "ProxyCommand=true",
                        "-o", "BatchMode=yes", host], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=30)
    if "kex_exchange_identification" not in v.stderr and "Connection closed" not in v.stderr:
        return None  # ssh stopped before loading keys (an unusable IdentityFile)
    files: list[str] = []
    for m in re.finditer(r"^debug1: identity file (.*) type -?\d+$", v.stderr, re.M):
        path = m.group(1)
        if files and path == files[-1] + "-cert":
            continue
        files.append(path)
    view["identityfile"] = files
    return view


def tunnel_view(tunnel_bin: Path, config: Path, host: str, env: dict):
    r = subprocess.run([str(tunnel_bin), "config", "-F", str(config), host, "--json"],
                       capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                       timeout=30)
    if r.returncode != 0:
        return r
    data = json.loads(r.stdout)
    return {k: data[k] for k in COMPARED if k in data}


def differences(ssh: dict, tunnel: dict) -> list[str]:
    diffs = []
    for key in COMPARED:
        s, t = ssh.get(key), tunnel.get(key)
        if s == t:
            continue
        choice = PRODUCT_CHOICES.get((key, str(s)))
        if choice is not None and t == choice[0]:
            continue
        diffs.append(f"{key}: ssh {s!r}, tunnel {t!r}")
    return diffs


def write_case(case: Case, root: Path) -> tuple[Path, Path]:
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    confd = root / "conf.d"
    confd.mkdir()
    for name, text in case.ssh_dir_files.items():
        (home / ".ssh" / name).write_text(text.replace(CONFD, str(confd)))
    for name, text in case.confd_files.items():
        (confd / name).write_text(text.replace(CONFD, str(confd)))
    config = root / "config"
    config.write_text(case.main.replace(CONFD, str(confd)))
    return config, home


@pytest.fixture(scope="module")
def ssh_client():
    path = shutil.which("ssh")
    assert path, "the OpenSSH client is needed (scripts/setup installs openssh-client)"
    return path


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_tunnel_resolves_as_openssh(case, tunnel_bin, tmp_path, ssh_client):
    config, home = write_case(case, tmp_path)
    env = _env(home)
    report = []
    for host in case.hosts:
        ssh = ssh_view(config, host, env)
        tunnel = tunnel_view(tunnel_bin, config, host, env)
        if ssh is None:
            if isinstance(tunnel, dict):
                report.append(f"{host}: ssh refuses this config, tunnel resolved {tunnel}")
            elif tunnel.returncode not in (3, 5):
                report.append(f"{host}: ssh refuses, tunnel exits {tunnel.returncode} (not 3/5):"
                              f" {tunnel.stderr}")
            continue
        if not isinstance(tunnel, dict):
            report.append(f"{host}: ssh resolves it, tunnel exits {tunnel.returncode}: "
                          f"{tunnel.stderr.strip()}")
            continue
        for d in differences(ssh, tunnel):
            report.append(f"{host}: {d}")
    assert not report, f"config {case.name}:\n{config.read_text()}\n" + "\n".join(report)


def test_corpus_is_large_and_covers_every_feature():
    assert len(CORPUS) >= 100
    seen = set().union(*(c.features for c in CORPUS))
    wanted = {f"option:{k}" for k in ("hostname", "user", "port", "identityfile",
                                      "identitiesonly", "identityagent", "proxyjump",
                                      "stricthostkeychecking", "userknownhostsfile",
                                      "globalknownhostsfile", "hostkeyalias",
                                      "serveraliveinterval", "serveralivecountmax",
                                      "connecttimeout")}
    wanted |= {f"match:{k}" for k in ("all", "host", "originalhost", "user", "localuser", "exec",
                                      "final", "canonical", "negated", "several")}
    wanted |= {"host:wildcard", "host:negated", "include:relative", "include:tilde-glob",
               "include:absolute-glob", "include:conditional", "include:toplevel", "tokens",
               "env", "canonicalize"}
    assert wanted <= seen, f"not covered: {sorted(wanted - seen)}"
    assert CORPUS[0].name == "issue-15-match"
    errors = [c for c in CORPUS if c.name.startswith("error-")]
    assert len(errors) >= 5


def test_options_tunnel_refuses_are_refused_clearly(tunnel_bin, tmp_path, ssh_client):
    """ssh accepts these; tunnel cannot honour them and says so (exit 3), never ignores them."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    env = _env(home)
    for option, value in [("ProxyCommand", "nc %h %p"), ("KnownHostsCommand", "/bin/cat %H"),
                          ("RevokedHostKeys", "/etc/ssh/revoked"),
                          ("CanonicalizePermittedCNAMEs", "*.a.example:*.b.example")]:
        config = tmp_path / f"{option}.conf"
        # With CNAME rules ssh looks the name up, so it must resolve: localhost.
        host = "localhost" if option.startswith("Canonicalize") else "gpu"
        extra = "CanonicalizeHostname yes\n" if option.startswith("Canonicalize") else ""
        config.write_text(f"{extra}Host {host}\n  {option} {value}\n")
        assert ssh_view(config, host, env) is not None, f"ssh should accept {option}"
        r = tunnel_view(tunnel_bin, config, host, env)
        assert not isinstance(r, dict), f"tunnel resolved {option}: {r}"
        assert r.returncode == 3, r.stderr
        assert option in r.stderr and f"{config} line" in r.stderr, r.stderr
