//! OpenSSH known_hosts files: lookup (plain, wildcard, negated and hashed
//! entries, `[host]:port`, `@revoked`), host certificates checked against
//! `@cert-authority` lines, and recording of accepted keys.
//!
//! russh ships a checker, but it reads only `~/.ssh/known_hosts` and exact
//! names; ssh users rely on `UserKnownHostsFile`, patterns and the global file.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use russh::keys::ssh_key::certificate::CertType;
use russh::keys::ssh_key::{Certificate, Fingerprint, PublicKey};
use russh::keys::{Algorithm, HashAlg};
use sha1::Sha1;

#[derive(Debug, thiserror::Error)]
pub enum KnownHostsError {
    #[error("cannot read known_hosts file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot record the host key in {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no known_hosts file to record the key in (UserKnownHostsFile is none)")]
    NoUserFile,
    #[error("cannot encode the host key: {0}")]
    Encode(String),
}

/// Why a host certificate is not accepted; shown after "known_hosts does
/// not vouch for:" (connect.rs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    /// Signed by an authority no `@cert-authority` line names.
    #[error(
        "it is signed by the authority {0}, which no @cert-authority line for this host names"
    )]
    UnknownAuthority(Fingerprint),
    #[error("it is a user certificate, not a host certificate")]
    UserCertificate,
    #[error("its signature does not verify")]
    BadSignature,
    /// Not valid yet: its validity starts `after` (seconds since the epoch).
    #[error("it is not valid before {}", time_text(*after))]
    NotYetValid { after: u64 },
    /// Its validity ended `before` (seconds since the epoch).
    #[error("it expired at {}", time_text(*before))]
    Expired { before: u64 },
    #[error("it is for {}, not {principal}", principals.join(", "))]
    OtherPrincipals {
        principals: Vec<String>,
        principal: String,
    },
    #[error("it has the critical option {0:?}, which tunnel does not know")]
    CriticalOption(String),
}

/// A known_hosts line, located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub line: usize,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// Outcome of looking a host key up.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The key is recorded for this host.
    Known(Location),
    /// Other keys are recorded for this host, not this one.
    Changed { recorded: PublicKey, at: Location },
    /// The key is marked `@revoked`.
    Revoked(Location),
    /// Nothing is recorded for this host.
    Unknown,
}

#[derive(Debug, Clone)]
pub struct KnownHosts {
    /// Read first; new keys go to the first one.
    pub user_files: Vec<PathBuf>,
    pub global_files: Vec<PathBuf>,
}

struct Entry {
    marker: Marker,
    hosts: String,
    key: PublicKey,
    at: Location,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    None,
    Revoked,
    CertAuthority,
}

impl KnownHosts {
    fn entries(&self) -> Result<Vec<Entry>, KnownHostsError> {
        let mut out = Vec::new();
        for path in self.user_files.iter().chain(&self.global_files) {
            let file = match File::open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(KnownHostsError::Read {
                        path: path.clone(),
                        source,
                    })
                }
            };
            for (idx, line) in BufReader::new(file).lines().enumerate() {
                let line = line.map_err(|source| KnownHostsError::Read {
                    path: path.clone(),
                    source,
                })?;
                let at = Location {
                    file: path.clone(),
                    line: idx + 1,
                };
                if let Some(entry) = parse_line(&line, at) {
                    out.push(entry);
                }
            }
        }
        Ok(out)
    }

    /// Look `key` up for `name` (`host` or `[host]:port`).
    pub fn check(&self, name: &str, key: &PublicKey) -> Result<Lookup, KnownHostsError> {
        let name = name.to_ascii_lowercase();
        let entries = self.entries()?;
        for e in &entries {
            if e.marker == Marker::Revoked && e.key.key_data() == key.key_data() {
                return Ok(Lookup::Revoked(e.at.clone()));
            }
        }
        let for_host: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.marker == Marker::None && host_matches(&name, &e.hosts))
            .collect();
        if let Some(e) = for_host.iter().find(|e| e.key.key_data() == key.key_data()) {
            return Ok(Lookup::Known(e.at.clone()));
        }
        // Prefer reporting a recorded key of the same type, as ssh does.
        let changed = for_host
            .iter()
            .find(|e| e.key.algorithm() == key.algorithm())
            .or_else(|| for_host.first());
        Ok(match changed {
            Some(e) => Lookup::Changed {
                recorded: e.key.clone(),
                at: e.at.clone(),
            },
            None => Lookup::Unknown,
        })
    }

    /// The `@cert-authority` lines whose host patterns cover `name` (`host`
    /// or `[host]:port`, as for plain keys): the authorities trusted to sign
    /// its host certificates.
    pub fn authorities_for(&self, name: &str) -> Result<Vec<Authority>, KnownHostsError> {
        let name = name.to_ascii_lowercase();
        Ok(self
            .entries()?
            .into_iter()
            .filter(|e| e.marker == Marker::CertAuthority && host_matches(&name, &e.hosts))
            .map(|e| Authority {
                key: e.key,
                at: e.at,
            })
            .collect())
    }

    /// The `@revoked` line for `key`, if any.
    pub fn revoked(&self, key: &PublicKey) -> Result<Option<Location>, KnownHostsError> {
        Ok(self
            .entries()?
            .into_iter()
            .find(|e| e.marker == Marker::Revoked && e.key.key_data() == key.key_data())
            .map(|e| e.at))
    }

    /// Algorithms of the keys recorded for `name`, so the handshake can ask
    /// for a key type we can verify (as OpenSSH orders HostKeyAlgorithms).
    pub fn algorithms_for(&self, name: &str) -> Vec<Algorithm> {
        let name = name.to_ascii_lowercase();
        let mut algs = Vec::new();
        for e in self.entries().unwrap_or_default() {
            if e.marker == Marker::None && host_matches(&name, &e.hosts) {
                let a = e.key.algorithm();
                if !algs.contains(&a) {
                    algs.push(a);
                }
            }
        }
        algs
    }

    /// Append `key` for `name` to the first user file (created 0600, its
    /// directory 0700, if missing). Returns the file written.
    pub fn learn(
        &self,
        name: &str,
        key: &PublicKey,
        hash: bool,
    ) -> Result<PathBuf, KnownHostsError> {
        let path = self.user_files.first().ok_or(KnownHostsError::NoUserFile)?;
        let werr = |source| KnownHostsError::Write {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() {
                crate::platform::create_private_dir_all(dir).map_err(werr)?;
            }
        }
        let host_field = if hash {
            hash_name(&name.to_ascii_lowercase())
        } else {
            name.to_ascii_lowercase()
        };
        let mut bare = key.clone();
        bare.set_comment("");
        let key_text = bare
            .to_openssh()
            .map_err(|e| KnownHostsError::Encode(e.to_string()))?;
        let mut file = crate::platform::open_private_append(path).map_err(werr)?;
        // Do not glue our line onto a last line that lacks its newline.
        let len = file.metadata().map_err(werr)?.len();
        let mut prefix = "";
        if len > 0 {
            file.seek(SeekFrom::End(-1)).map_err(werr)?;
            let mut last = [0u8; 1];
            file.read_exact(&mut last).map_err(werr)?;
            if last[0] != b'\n' {
                prefix = "\n";
            }
        }
        writeln!(file, "{prefix}{host_field} {}", key_text.trim()).map_err(werr)?;
        Ok(path.clone())
    }
}

/// A certificate authority for some hosts, from a `@cert-authority` line.
#[derive(Debug, Clone)]
pub struct Authority {
    pub key: PublicKey,
    pub at: Location,
}

/// Check a host certificate as OpenSSH's `check_host_cert` does: signed by
/// one of `authorities`, a host (not user) certificate, valid at `now`
/// (seconds since the epoch), `principal` among its principals (an empty
/// list is valid for any host), and no critical option (none is defined
/// for host certificates). The authority's line, or why not.
pub fn check_certificate(
    cert: &Certificate,
    principal: &str,
    authorities: &[Authority],
    now: u64,
) -> Result<Location, CertificateError> {
    let signer = cert.signature_key();
    let fingerprint = signer.fingerprint(HashAlg::Sha256);
    let Some(ca) = authorities.iter().find(|a| a.key.key_data() == signer) else {
        return Err(CertificateError::UnknownAuthority(fingerprint));
    };
    if cert.cert_type() != CertType::Host {
        return Err(CertificateError::UserCertificate);
    }
    // Signature and validity window (and the signer again, by fingerprint).
    if cert.validate_at(now, [&fingerprint]).is_err() {
        return Err(if cert.verify_signature().is_err() {
            CertificateError::BadSignature
        } else if now < cert.valid_after() {
            CertificateError::NotYetValid {
                after: cert.valid_after(),
            }
        } else {
            CertificateError::Expired {
                before: cert.valid_before(),
            }
        });
    }
    let principals = cert.valid_principals();
    if !principals.is_empty() && !principals.iter().any(|p| p == principal) {
        return Err(CertificateError::OtherPrincipals {
            principals: principals.to_vec(),
            principal: principal.to_string(),
        });
    }
    if let Some((option, _)) = cert.critical_options().iter().next() {
        return Err(CertificateError::CriticalOption(option.clone()));
    }
    Ok(ca.at.clone())
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM:SS UTC` (the far future, as
/// ssh-keygen's "forever", is shown as such).
fn time_text(secs: u64) -> String {
    if secs >= i64::MAX as u64 {
        return "forever".into();
    }
    let days = secs / 86400;
    let rem = secs % 86400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

fn parse_line(line: &str, at: Location) -> Option<Entry> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let mut fields = line.split_whitespace();
    let mut first = fields.next()?;
    let marker = match first {
        "@revoked" => Marker::Revoked,
        "@cert-authority" => Marker::CertAuthority,
        m if m.starts_with('@') => return None,
        _ => Marker::None,
    };
    if marker != Marker::None {
        first = fields.next()?;
    }
    let key_type = fields.next()?;
    let key_b64 = fields.next()?;
    match PublicKey::from_openssh(&format!("{key_type} {key_b64}")) {
        Ok(key) => Some(Entry {
            marker,
            hosts: first.to_string(),
            key,
            at,
        }),
        Err(e) => {
            tracing::debug!("skipping {at}: unreadable key ({e})");
            None
        }
    }
}

/// OpenSSH `match_hostname`: comma-separated patterns, `!` negates, `|1|`
/// entries are HMAC-SHA1 hashes of the name.
fn host_matches(name: &str, patterns: &str) -> bool {
    let mut matched = false;
    for pat in patterns.split(',') {
        if let Some(hashed) = pat.strip_prefix("|1|") {
            if hashed_matches(name, hashed) {
                matched = true;
            }
            continue;
        }
        let (negated, pat) = match pat.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, pat),
        };
        if wildcard_match(&pat.to_ascii_lowercase(), name) {
            if negated {
                return false;
            }
            matched = true;
        }
    }
    matched
}

fn hashed_matches(name: &str, salt_and_hash: &str) -> bool {
    let Some((salt, hash)) = salt_and_hash.split_once('|') else {
        return false;
    };
    let (Ok(salt), Ok(hash)) = (B64.decode(salt), B64.decode(hash)) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha1>::new_from_slice(&salt) else {
        return false;
    };
    mac.update(name.as_bytes());
    mac.verify_slice(&hash).is_ok()
}

fn hash_name(name: &str) -> String {
    let mut salt = [0u8; 20];
    // A salt only hides names from casual reading; on the rare failure of the
    // OS RNG, fall back to a plain entry rather than refusing to record.
    if getrandom::fill(&mut salt).is_err() {
        return name.to_string();
    }
    let Ok(mut mac) = Hmac::<Sha1>::new_from_slice(&salt) else {
        return name.to_string();
    };
    mac.update(name.as_bytes());
    let hash = mac.finalize().into_bytes();
    format!("|1|{}|{}", B64.encode(salt), B64.encode(hash))
}

/// `*` and `?` globbing, as in ssh's match_pattern.
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// `SHA256:...`, as ssh prints it.
pub fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

/// Human name of the key type, e.g. `ED25519`.
pub fn key_type(key: &PublicKey) -> String {
    match key.algorithm() {
        Algorithm::Ed25519 => "ED25519".into(),
        Algorithm::Rsa { .. } => "RSA".into(),
        Algorithm::Ecdsa { .. } => "ECDSA".into(),
        other => other.to_string(),
    }
}

/// The text of line `at` (for messages), trimmed.
pub fn line_text(at: &Location) -> Option<String> {
    let f = File::open(&at.file).ok()?;
    BufReader::new(f)
        .lines()
        .nth(at.line.checked_sub(1)?)
        .and_then(Result::ok)
        .map(|l| l.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    // Generated with ssh-keygen; HASHED is `ssh-keygen -H` of "[gpu.example.org]:2222 K1".
    const K1: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJL5PxvuM170rxZR1jnhSBGBAi3YVV3xNczSHJOHAJdP";
    const K2: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBe7iiE4HDUZP4YQz910czgCaBpAPy/vQvT/I6cOvu5s";
    const HASHED: &str = "|1|SzoKjrEySOBi3pMFaXqqwneYxrI=|3zTZmm5/k8YbmLXB7npib8pKya8=";
    const K1_FP: &str = "SHA256:jDQ6WVT4PhCSLYV2k/Uf6TZJSq7PgOlBxo67+NHN2Io";

    fn key(s: &str) -> PublicKey {
        PublicKey::from_openssh(s).expect("valid test key")
    }

    fn kh(content: &str) -> (tempfile::TempDir, KnownHosts) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("known_hosts");
        fs::write(&path, content).expect("write");
        let kh = KnownHosts {
            user_files: vec![path],
            global_files: vec![dir.path().join("absent")],
        };
        (dir, kh)
    }

    #[test]
    fn hashed_entry_from_ssh_keygen_matches() {
        let (_d, kh) = kh(&format!("# comment\n\n{HASHED} {K1}\n"));
        let got = kh.check("[gpu.example.org]:2222", &key(K1)).expect("reads");
        assert!(
            matches!(got, Lookup::Known(Location { line: 3, .. })),
            "{got:?}"
        );
        // Same host, other port: a different name.
        let got = kh.check("gpu.example.org", &key(K1)).expect("reads");
        assert_eq!(got, Lookup::Unknown);
    }

    #[test]
    fn changed_key_is_reported_with_its_line() {
        let (_d, kh) = kh(&format!("other {K2}\n[gpu.example.org]:2222 {K1}\n"));
        match kh.check("[GPU.example.org]:2222", &key(K2)).expect("reads") {
            Lookup::Changed { recorded, at } => {
                assert_eq!(fingerprint(&recorded), K1_FP);
                assert_eq!(at.line, 2);
                assert_eq!(
                    line_text(&at).as_deref(),
                    Some(format!("[gpu.example.org]:2222 {K1}").as_str())
                );
            }
            other => panic!("expected Changed, got {other:?}"),
        }
    }

    #[test]
    fn patterns_and_negation() {
        let (_d, kh) = kh(&format!(
            "*.cluster,!bad.cluster {K1}\nh?st,10.0.0.1 {K2}\n"
        ));
        assert!(matches!(
            kh.check("node1.cluster", &key(K1)).expect("reads"),
            Lookup::Known(_)
        ));
        assert_eq!(
            kh.check("bad.cluster", &key(K1)).expect("reads"),
            Lookup::Unknown
        );
        assert!(matches!(
            kh.check("host", &key(K2)).expect("reads"),
            Lookup::Known(_)
        ));
        assert!(matches!(
            kh.check("10.0.0.1", &key(K2)).expect("reads"),
            Lookup::Known(_)
        ));
        assert_eq!(kh.check("hoost", &key(K2)).expect("reads"), Lookup::Unknown);
    }

    #[test]
    fn revoked_and_cert_authority_markers() {
        let (_d, kh) = kh(&format!(
            "@revoked * {K1}\n@cert-authority * {K2}\nhost {K1}\n"
        ));
        assert!(matches!(
            kh.check("host", &key(K1)).expect("reads"),
            Lookup::Revoked(_)
        ));
        // A CA line is not a host key for the host.
        assert_eq!(kh.check("other", &key(K2)).expect("reads"), Lookup::Unknown);
    }

    /// `ssh-keygen` makes a CA and a host key in `dir`, and signs the host key
    /// with `args` (`-h -n NAME`, `-V ...`); the certificate.
    #[cfg(unix)]
    fn ssh_keygen_cert(dir: &std::path::Path, tag: &str, args: &[&str]) -> Certificate {
        let keygen = |a: &[&str]| {
            let out = std::process::Command::new("ssh-keygen")
                .args(a)
                .output()
                .expect("ssh-keygen runs");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ca = dir.join("ca");
        if !ca.exists() {
            keygen(&["-q", "-t", "ed25519", "-N", "", "-f", &ca.to_string_lossy()]);
        }
        let host = dir.join(tag);
        keygen(&[
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-f",
            &host.to_string_lossy(),
        ]);
        let mut sign = vec!["-q", "-s", ca.to_str().expect("utf8"), "-I", tag];
        sign.extend_from_slice(args);
        let host_pub = format!("{}.pub", host.display());
        sign.push(&host_pub);
        keygen(&sign);
        let text = fs::read_to_string(format!("{}-cert.pub", host.display())).expect("cert");
        Certificate::from_openssh(text.trim()).expect("parses")
    }

    // Needs ssh-keygen (OpenSSH for Linux) to make the certificates.
    #[cfg(unix)]
    #[test]
    fn host_certificates_are_checked_against_cert_authority_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let good = ssh_keygen_cert(
            d,
            "good",
            &["-h", "-n", "gpu.example,gpu", "-V", "20260101:20300101"],
        );
        let any = ssh_keygen_cert(d, "any", &["-h"]);
        let other_name = ssh_keygen_cert(d, "other", &["-h", "-n", "web.example"]);
        let user = ssh_keygen_cert(d, "user", &["-n", "gpu.example"]);
        let expired = ssh_keygen_cert(
            d,
            "old",
            &["-h", "-n", "gpu.example", "-V", "20200101:20200102"],
        );
        let ca = fs::read_to_string(d.join("ca.pub")).expect("ca");
        let ca = ca.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        let (_k, kh) = kh(&format!("@cert-authority *.example,[*.example]:* {ca}\n"));
        let now = 1_800_000_000; // 2027
        let auth = kh.authorities_for("gpu.example").expect("reads");
        assert_eq!(auth.len(), 1);
        assert_eq!(auth[0].at.line, 1);
        assert_eq!(
            kh.authorities_for("[gpu.example]:2222")
                .expect("reads")
                .len(),
            1
        );
        assert!(kh.authorities_for("gpu.other").expect("reads").is_empty());

        assert_eq!(
            check_certificate(&good, "gpu.example", &auth, now),
            Ok(auth[0].at.clone())
        );
        assert!(check_certificate(&any, "gpu.example", &auth, now).is_ok());
        let why = |c: &Certificate| {
            check_certificate(c, "gpu.example", &auth, now)
                .expect_err("refused")
                .to_string()
        };
        assert_eq!(why(&other_name), "it is for web.example, not gpu.example");
        assert_eq!(
            why(&user),
            "it is a user certificate, not a host certificate"
        );
        assert!(
            why(&expired).starts_with("it expired at 2020-01-02 00:00:00"),
            "{}",
            why(&expired)
        );
        assert!(check_certificate(&good, "gpu.example", &auth, 1_000)
            .expect_err("before")
            .to_string()
            .starts_with("it is not valid before"));
        // Signed by an authority that is not the one known_hosts names.
        let stranger = tempfile::tempdir().expect("tempdir");
        let foreign = ssh_keygen_cert(stranger.path(), "f", &["-h", "-n", "gpu.example"]);
        assert!(why(&foreign).contains("which no @cert-authority line for this host names"));
        assert_eq!(time_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(time_text(u64::MAX), "forever");
    }

    #[test]
    fn learn_appends_plain_and_hashed_and_is_private() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub").join("known_hosts");
        let kh = KnownHosts {
            user_files: vec![path.clone()],
            global_files: vec![],
        };
        assert_eq!(
            kh.check("[h]:2222", &key(K1)).expect("reads"),
            Lookup::Unknown
        );
        kh.learn("[h]:2222", &key(K1), false).expect("learn");
        assert!(matches!(
            kh.check("[h]:2222", &key(K1)).expect("reads"),
            Lookup::Known(_)
        ));
        crate::platform::assert_private(&path);

        // A file whose last line lacks a newline stays well formed.
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        write!(f, "# no newline").expect("write");
        kh.learn("hashed.example", &key(K2), true)
            .expect("learn hashed");
        let text = fs::read_to_string(&path).expect("read");
        assert!(
            !text.contains("hashed.example"),
            "name must be hashed: {text}"
        );
        assert!(text.lines().any(|l| l.starts_with("|1|")));
        assert!(matches!(
            kh.check("hashed.example", &key(K2)).expect("reads"),
            Lookup::Known(_)
        ));
        assert_eq!(
            kh.algorithms_for("hashed.example"),
            vec![Algorithm::Ed25519]
        );
    }

    #[test]
    fn wildcards() {
        assert!(wildcard_match("*", "anything"));
        assert!(wildcard_match("a*c", "abbbc"));
        assert!(wildcard_match("a?c", "abc"));
        assert!(!wildcard_match("a?c", "abbc"));
        assert!(wildcard_match("*.x.*", "a.x.b"));
        assert!(!wildcard_match("*.x", "a.y"));
    }
}
