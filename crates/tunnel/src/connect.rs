//! Reaching the host: DNS, TCP, SSH handshake and host-key verification.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::client;
use russh::keys::ssh_key::{Certificate, PublicKey};
use russh::keys::{Algorithm, PublicKeyOrCertificate};
use tokio::net::TcpStream;

use crate::config::{StrictHostKeyChecking, Target};
use crate::exit::{Exit, HasExit};
use crate::known_hosts::{self, KnownHosts, KnownHostsError, Location, Lookup};
use crate::prompt;

/// Used when the ssh config sets no ConnectTimeout (ssh would wait for the
/// kernel's TCP timeout, minutes).
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Used when the ssh config sets no ServerAliveInterval: a dead link must be
/// noticed, since the remote server is only stopped through this session, and
/// noticed soon, since the notebook hangs until the session is restored.
/// russh gives up after ServerAliveCountMax (ssh's default 3) unanswered
/// probes, i.e. after (count + 1) intervals of silence: 16 s here, so a link
/// that is down for 20 s is already being redialled when it comes back (at
/// 15 s it went unnoticed for a minute). An idle probe every 4 s costs a few
/// bytes; a false alarm costs one reconnect to the same URL and kernels.
pub(crate) const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(4);
/// While a TCP connect goes unanswered, start a fresh one this often (the
/// earlier ones go on; the first to connect wins). A connect begun while the
/// link was down only retries its SYN at 1, 3, 7, 15 s, from the source
/// address picked back then, which may no longer route (the laptop changed
/// networks): alone it could leave a tunnel down for most of ConnectTimeout
/// after the network came back.
const REDIAL_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(
        "unknown host {alias:?}: no Host entry for it in the ssh config and it is not a \
         resolvable host name ({detail})"
    )]
    UnknownAlias { alias: String, detail: String },
    #[error("cannot resolve {host} (HostName of {alias}): {detail}")]
    Dns {
        alias: String,
        host: String,
        detail: String,
    },
    #[error("connection to {host} port {port} refused ({addr}): is sshd running there?")]
    Refused {
        host: String,
        port: u16,
        addr: SocketAddr,
    },
    #[error("cannot connect to {host} port {port}: {detail}")]
    Unreachable {
        host: String,
        port: u16,
        detail: String,
    },
    #[error("timed out after {}s {stage} {host} port {port}", timeout.as_secs())]
    Timeout {
        stage: &'static str,
        host: String,
        port: u16,
        timeout: Duration,
    },
    #[error("{0}")]
    HostKey(#[from] HostKeyError),
    #[error("jump host {via} cannot reach {host} port {port}: {source}")]
    Jump {
        via: String,
        host: String,
        port: u16,
        source: russh::Error,
    },
    #[error("SSH handshake with {host} port {port} failed: {source}")]
    Handshake {
        host: String,
        port: u16,
        source: russh::Error,
    },
}

impl HasExit for ConnectError {
    fn exit(&self) -> Exit {
        match self {
            ConnectError::UnknownAlias { .. } => Exit::UnknownAlias,
            ConnectError::Dns { .. } => Exit::Dns,
            ConnectError::Refused { .. }
            | ConnectError::Unreachable { .. }
            | ConnectError::Jump { .. }
            | ConnectError::Handshake { .. } => Exit::Refused,
            ConnectError::Timeout { .. } => Exit::Timeout,
            ConnectError::HostKey(e) => e.exit(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostKeyError {
    #[error(
        "HOST KEY CHANGED for {name}: refusing to connect (someone may be intercepting the \
         connection, or the host was reinstalled).\n  \
         server now offers: {key_type} {offered}\n  \
         known_hosts has:   {recorded_type} {recorded} at {at}\n  \
         {line}\n\
         If the change is expected, remove the old entry (ssh-keygen -R '{name}{file_opt}') and retry."
    )]
    Changed {
        name: String,
        key_type: String,
        offered: String,
        recorded_type: String,
        recorded: String,
        at: Location,
        line: String,
        file_opt: String,
    },
    #[error("host key {key_type} {fingerprint} of {name} is marked @revoked at {at}: refusing to connect")]
    Revoked {
        name: String,
        key_type: String,
        fingerprint: String,
        at: Location,
    },
    #[error(
        "host {name} is not known: its {key_type} key fingerprint is {fingerprint}.\n\
         {reason}. If this fingerprint is right, run again with --accept-new \
         (or set StrictHostKeyChecking accept-new for this host)."
    )]
    Unknown {
        name: String,
        key_type: String,
        fingerprint: String,
        reason: String,
    },
    #[error(
        "{name} presented a host certificate that known_hosts does not vouch for: {reason}.\n  \
         trusted for this host: {authorities}\n\
         Refusing to connect. If the server's certificate was re-issued, ask its admin which \
         authority signs it now and update the @cert-authority line."
    )]
    Certificate {
        name: String,
        reason: known_hosts::CertificateError,
        authorities: String,
    },
    #[error(
        "host {name} is not known: it offered a plain {key_type} key {fingerprint}, but \
         {at} says its keys are certified by an authority (@cert-authority):\n  {line}\n\
         A plain key for such a host is not recorded on first use (--accept-new, \
         StrictHostKeyChecking accept-new): an impostor would offer exactly this. Ask the \
         server's admin whether its HostCertificate is missing; if the fingerprint is right, \
         add the key to known_hosts yourself ('{name} <key>') and retry."
    )]
    PlainKeyForCertifiedHost {
        name: String,
        key_type: String,
        fingerprint: String,
        at: Location,
        line: String,
    },
    #[error(transparent)]
    KnownHosts(#[from] KnownHostsError),
}

impl HasExit for HostKeyError {
    fn exit(&self) -> Exit {
        match self {
            HostKeyError::Changed { .. } | HostKeyError::Revoked { .. } => Exit::HostKeyChanged,
            HostKeyError::Unknown { .. }
            | HostKeyError::Certificate { .. }
            | HostKeyError::PlainKeyForCertifiedHost { .. } => Exit::HostKeyUnknown,
            HostKeyError::KnownHosts(_) => Exit::Config,
        }
    }
}

/// Host-key policy for one host, applied during the handshake.
#[derive(Debug, Clone)]
pub struct HostKeyPolicy {
    pub known_hosts: KnownHosts,
    /// `host` or `[host]:port`, after HostKeyAlias.
    pub name: String,
    /// The name a host certificate must be issued for: HostKeyAlias, else
    /// HostName (without the port), as OpenSSH checks it.
    pub principal: String,
    pub strict: StrictHostKeyChecking,
    pub hash_new_entries: bool,
}

impl HostKeyPolicy {
    pub fn for_target(target: &Target, accept_new: bool) -> Self {
        let strict = if accept_new {
            match target.strict_host_key_checking {
                StrictHostKeyChecking::No => StrictHostKeyChecking::No,
                _ => StrictHostKeyChecking::AcceptNew,
            }
        } else {
            target.strict_host_key_checking
        };
        HostKeyPolicy {
            known_hosts: KnownHosts {
                user_files: target.user_known_hosts.clone(),
                global_files: target.global_known_hosts.clone(),
            },
            name: target.known_hosts_name(),
            principal: target
                .host_key_alias
                .clone()
                .unwrap_or_else(|| target.host_name.clone())
                .to_ascii_lowercase(),
            strict,
            hash_new_entries: target.hash_known_hosts,
        }
    }

    /// Accept (and possibly record) `key`, or say why not.
    async fn verify(&self, key: &PublicKey) -> Result<(), HostKeyError> {
        let fingerprint = known_hosts::fingerprint(key);
        let key_type = known_hosts::key_type(key);
        match self.known_hosts.check(&self.name, key)? {
            Lookup::Known(at) => {
                tracing::debug!("host key {key_type} {fingerprint} known ({at})");
                Ok(())
            }
            Lookup::Changed { recorded, at } => {
                let file_opt = if at
                    .file
                    .starts_with(dirs::home_dir().unwrap_or_default().join(".ssh"))
                {
                    String::new()
                } else {
                    format!("' -f '{}", at.file.display())
                };
                Err(HostKeyError::Changed {
                    name: self.name.clone(),
                    key_type,
                    offered: fingerprint,
                    recorded_type: known_hosts::key_type(&recorded),
                    recorded: known_hosts::fingerprint(&recorded),
                    line: known_hosts::line_text(&at).unwrap_or_default(),
                    at,
                    file_opt,
                })
            }
            Lookup::Revoked(at) => Err(HostKeyError::Revoked {
                name: self.name.clone(),
                key_type,
                fingerprint,
                at,
            }),
            Lookup::Unknown => self.verify_new(key, key_type, fingerprint).await,
        }
    }

    /// A key nothing is recorded for: refused, confirmed at the terminal, or
    /// accepted as StrictHostKeyChecking says; recorded when accepted.
    async fn verify_new(
        &self,
        key: &PublicKey,
        key_type: String,
        fingerprint: String,
    ) -> Result<(), HostKeyError> {
        if self.strict == StrictHostKeyChecking::AcceptNew {
            if let Some(refusal) = self.refusal_if_certified(&key_type, &fingerprint)? {
                return Err(refusal);
            }
        }
        let refused = |reason: &str| HostKeyError::Unknown {
            name: self.name.clone(),
            key_type: key_type.clone(),
            fingerprint: fingerprint.clone(),
            reason: reason.into(),
        };
        match self.strict {
            StrictHostKeyChecking::AcceptNew | StrictHostKeyChecking::No => {}
            StrictHostKeyChecking::Yes => return Err(refused("StrictHostKeyChecking is yes")),
            StrictHostKeyChecking::Ask => {
                let question = format!(
                    "The authenticity of host '{}' can't be established.\n\
                     {key_type} key fingerprint is {fingerprint}.\n\
                     Are you sure you want to continue connecting (yes/no/[fingerprint])? ",
                    self.name
                );
                let Some(answer) = prompt::ask(question).await else {
                    return Err(refused("There is no terminal to confirm it on"));
                };
                let a = answer.trim();
                if !(a.eq_ignore_ascii_case("yes") || a == fingerprint) {
                    return Err(refused("You did not confirm it"));
                }
            }
        }
        let file = self
            .known_hosts
            .learn(&self.name, key, self.hash_new_entries)?;
        tracing::warn!(
            "permanently added {} ({key_type} {fingerprint}) to {}",
            self.name,
            file.display()
        );
        Ok(())
    }

    /// A host certificate: checked against the `@cert-authority` lines for
    /// this host. Where none covers it, its key is checked as a plain key,
    /// as OpenSSH does ("No matching CA found. Retry with plain key").
    async fn verify_certificate(&self, cert: &Certificate) -> Result<(), HostKeyError> {
        let kh = &self.known_hosts;
        let authorities = kh.authorities_for(&self.name)?;
        let key = PublicKey::new(cert.public_key().clone(), "");
        if authorities.is_empty() {
            tracing::debug!(
                "no @cert-authority for {}: checking the certified key",
                self.name
            );
            return self.verify(&key).await;
        }
        let signer = PublicKey::new(cert.signature_key().clone(), "");
        for revoked in [&key, &signer] {
            if let Some(at) = kh.revoked(revoked)? {
                return Err(HostKeyError::Revoked {
                    name: self.name.clone(),
                    key_type: known_hosts::key_type(revoked),
                    fingerprint: known_hosts::fingerprint(revoked),
                    at,
                });
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        match known_hosts::check_certificate(cert, &self.principal, &authorities, now) {
            Ok(at) => {
                tracing::debug!(
                    "host certificate {} (key id {:?}) signed by the authority at {at}",
                    known_hosts::fingerprint(&key),
                    cert.key_id()
                );
                Ok(())
            }
            Err(reason) => Err(HostKeyError::Certificate {
                name: self.name.clone(),
                reason,
                authorities: authorities
                    .iter()
                    .map(|a| format!("{} ({})", known_hosts::fingerprint(&a.key), a.at))
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// On first use, a plain key is not recorded for a host whose keys an
    /// authority certifies: that is what a man in the middle without the
    /// authority's signature would offer.
    fn refusal_if_certified(
        &self,
        key_type: &str,
        fingerprint: &str,
    ) -> Result<Option<HostKeyError>, KnownHostsError> {
        let ca = self
            .known_hosts
            .authorities_for(&self.name)?
            .into_iter()
            .next();
        Ok(ca.map(|ca| HostKeyError::PlainKeyForCertifiedHost {
            name: self.name.clone(),
            key_type: key_type.to_string(),
            fingerprint: fingerprint.to_string(),
            line: known_hosts::line_text(&ca.at).unwrap_or_default(),
            at: ca.at,
        }))
    }
}

/// The russh event handler: checks the host key and shows banners.
pub struct Client {
    policy: HostKeyPolicy,
    /// Why the key was refused, read back after russh reports `UnknownKey`.
    refusal: Arc<Mutex<Option<HostKeyError>>>,
    /// The jump hosts this session travels through: a hop's session ends
    /// when its last handle is dropped, so the session above owns them.
    _jumps: Vec<Arc<Handle>>,
}

impl client::Handler for Client {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let result = match key {
            PublicKeyOrCertificate::PublicKey { key, .. } => self.policy.verify(key).await,
            PublicKeyOrCertificate::Certificate(cert) => self.policy.verify_certificate(cert).await,
        };
        match result {
            Ok(()) => Ok(true),
            Err(e) => {
                if let Ok(mut slot) = self.refusal.lock() {
                    *slot = Some(e);
                }
                Ok(false)
            }
        }
    }

    async fn auth_banner(
        &mut self,
        banner: &str,
        _session: &mut client::Session,
    ) -> Result<(), Self::Error> {
        // The server's text, not ours: escape what a terminal would obey.
        eprint!("{}", crate::sanitize::for_terminal(banner));
        Ok(())
    }
}

pub type Handle = client::Handle<Client>;

/// An authenticated-to-be SSH session.
pub struct Connection {
    pub handle: Handle,
    pub peer: SocketAddr,
}

fn ssh_config(target: &Target, policy: &HostKeyPolicy) -> client::Config {
    let mut preferred = russh::Preferred::default();
    // Ask first for the key types already recorded for this host, so a host
    // with several keys is verified against the one we know (as ssh does).
    let known = policy.known_hosts.algorithms_for(&policy.name);
    if !known.is_empty() {
        let same_family = |a: &Algorithm| {
            known.iter().any(|k| match (k, a) {
                (Algorithm::Rsa { .. }, Algorithm::Rsa { .. }) => true,
                _ => k == a,
            })
        };
        let mut keys: Vec<Algorithm> = preferred
            .key
            .iter()
            .filter(|a| same_family(a))
            .cloned()
            .collect();
        keys.extend(preferred.key.iter().filter(|a| !same_family(a)).cloned());
        preferred.key = keys.into();
    }
    // Ask for a host certificate only where an authority could vouch for
    // one; elsewhere a certificate would only be checked as its plain key.
    if !policy
        .known_hosts
        .authorities_for(&policy.name)
        .unwrap_or_default()
        .is_empty()
    {
        preferred.host_key_certificates = preferred.key.clone();
    }
    client::Config {
        preferred,
        keepalive_interval: Some(target.server_alive_interval.unwrap_or(DEFAULT_KEEPALIVE)),
        keepalive_max: target.server_alive_count_max.max(1),
        inactivity_timeout: None,
        nodelay: true,
        // Notebook traffic is bursty; a large window keeps bulk transfers
        // (downloads of results) from stalling on window adjusts.
        window_size: 16 * 1024 * 1024,
        maximum_packet_size: 32 * 1024,
        channel_buffer_size: 256,
        ..Default::default()
    }
}

/// Resolve, connect and complete the SSH handshake (host key included).
pub async fn connect(target: &Target, policy: HostKeyPolicy) -> Result<Connection, ConnectError> {
    let timeout = target.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let addrs = resolve(target, timeout).await?;
    tracing::debug!("{} resolves to {addrs:?}", target.host_name);
    let (tcp, peer) = dial_first(target, &addrs, timeout).await?;
    // Interactive traffic: never wait to fill a segment.
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY: {e}");
    }
    let handle = handshake(target, policy, tcp, Vec::new()).await?;
    Ok(Connection { handle, peer })
}

/// The host's addresses; a name that does not resolve is told apart from an alias that the
/// ssh config does not have.
async fn resolve(target: &Target, timeout: Duration) -> Result<Vec<SocketAddr>, ConnectError> {
    let (host, port) = (target.host_name.clone(), target.port);
    let lookup = tokio::time::timeout(
        timeout,
        tokio::net::lookup_host((target.host_name.as_str(), port)),
    )
    .await;
    match lookup {
        Err(_) => Err(ConnectError::Timeout {
            stage: "resolving",
            host,
            port,
            timeout,
        }),
        Ok(Err(e)) => {
            let detail = dns_detail(&e);
            Err(if target.configured {
                ConnectError::Dns {
                    alias: target.alias.clone(),
                    host,
                    detail,
                }
            } else {
                ConnectError::UnknownAlias {
                    alias: target.alias.clone(),
                    detail,
                }
            })
        }
        Ok(Ok(a)) => Ok(a.collect()),
    }
}

/// The first address that accepts a TCP connection within `timeout`, as ssh tries them in
/// order; else the last address's error.
async fn dial_first(
    target: &Target,
    addrs: &[SocketAddr],
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), ConnectError> {
    let (host, port) = (&target.host_name, target.port);
    let mut last_err = None;
    for addr in addrs {
        tracing::debug!("connecting to {addr}");
        match tokio::time::timeout(timeout, dial(*addr)).await {
            Ok(Ok(s)) => return Ok((s, *addr)),
            Ok(Err(e)) => {
                tracing::debug!("{addr}: {e}");
                last_err = Some(match e.kind() {
                    std::io::ErrorKind::ConnectionRefused => ConnectError::Refused {
                        host: host.clone(),
                        port,
                        addr: *addr,
                    },
                    _ => ConnectError::Unreachable {
                        host: host.clone(),
                        port,
                        detail: format!("{addr}: {e}"),
                    },
                });
            }
            Err(_) => {
                last_err = Some(ConnectError::Timeout {
                    stage: "connecting to",
                    host: host.clone(),
                    port,
                    timeout,
                })
            }
        }
    }
    Err(last_err.unwrap_or(ConnectError::Unreachable {
        host: host.clone(),
        port,
        detail: "the name resolved to no address".into(),
    }))
}

/// TCP connect to `addr`, redialling every [`REDIAL_EVERY`] while no dial has
/// been answered; the first answer (a connection or an error such as
/// "refused") decides. The caller bounds the whole with its timeout; the
/// dials still pending are aborted when this returns or is dropped.
async fn dial(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut dials = tokio::task::JoinSet::new();
    dials.spawn(TcpStream::connect(addr));
    let mut redial =
        tokio::time::interval_at(tokio::time::Instant::now() + REDIAL_EVERY, REDIAL_EVERY);
    loop {
        tokio::select! {
            // (The set is never empty here: it only shrinks as we return.)
            Some(done) = dials.join_next() => {
                return done.unwrap_or_else(|e| Err(std::io::Error::other(e)));
            }
            _ = redial.tick() => {
                tracing::debug!("no answer from {addr} yet; dialling again");
                dials.spawn(TcpStream::connect(addr));
            }
        };
    }
}

/// Reach `target` through `jumps` (the last one opens the way): a
/// direct-tcpip channel from the last hop, then a full SSH handshake with
/// `target` over it, host key checked against `target`'s own policy.
pub async fn connect_via(
    jumps: Vec<Arc<Handle>>,
    via: &str,
    target: &Target,
    policy: HostKeyPolicy,
) -> Result<Handle, ConnectError> {
    let timeout = target.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let host = target.host_name.clone();
    let port = target.port;
    let Some(last) = jumps.last() else {
        return Ok(connect(target, policy).await?.handle);
    };
    let open = last.channel_open_direct_tcpip(host.clone(), u32::from(port), "127.0.0.1", 0);
    let channel = match tokio::time::timeout(timeout, open).await {
        Err(_) => {
            return Err(ConnectError::Timeout {
                stage: "opening a channel through the jump host to",
                host,
                port,
                timeout,
            })
        }
        Ok(Err(source)) => {
            return Err(ConnectError::Jump {
                via: via.to_string(),
                host,
                port,
                source,
            })
        }
        Ok(Ok(c)) => c,
    };
    handshake(target, policy, channel.into_stream(), jumps).await
}

/// The SSH handshake (host key included) over an established byte stream.
async fn handshake<S>(
    target: &Target,
    policy: HostKeyPolicy,
    stream: S,
    jumps: Vec<Arc<Handle>>,
) -> Result<Handle, ConnectError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let timeout = target.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let host = target.host_name.clone();
    let port = target.port;
    let refusal = Arc::new(Mutex::new(None));
    let handler = Client {
        policy: policy.clone(),
        refusal: refusal.clone(),
        _jumps: jumps,
    };
    let config = Arc::new(ssh_config(target, &policy));
    // The timeout covers the banner exchange and key exchange, as ssh's
    // ConnectTimeout does; an interactive host-key prompt gets its own time.
    let handshake = client::connect_stream(config, stream, handler);
    let handshake_timeout = if policy.strict == StrictHostKeyChecking::Ask && prompt::available() {
        timeout + Duration::from_secs(600)
    } else {
        timeout
    };
    match tokio::time::timeout(handshake_timeout, handshake).await {
        Err(_) => Err(ConnectError::Timeout {
            stage: "waiting for the SSH handshake with",
            host,
            port,
            timeout,
        }),
        Ok(Ok(handle)) => Ok(handle),
        Ok(Err(e)) => {
            let refused = refusal.lock().ok().and_then(|mut r| r.take());
            match refused {
                Some(why) => Err(why.into()),
                None => Err(ConnectError::Handshake {
                    host,
                    port,
                    source: e,
                }),
            }
        }
    }
}

/// getaddrinfo's message without Rust's prefix.
fn dns_detail(e: &std::io::Error) -> String {
    let s = e.to_string();
    s.strip_prefix("failed to lookup address information: ")
        .unwrap_or(&s)
        .to_string()
}
