//! User authentication, in ssh's order: agent, key files, then password.

use std::path::Path;
use std::sync::Arc;

use russh::client::AuthResult;
use russh::keys::agent::client::AgentClient;
use russh::keys::agent::AgentIdentity;
use russh::keys::ssh_key::PublicKey;
use russh::keys::{HashAlg, PrivateKey, PrivateKeyWithHashAlg};
use russh::MethodKind;

use crate::config::{AgentSocket, Target};
use crate::connect::Handle;
use crate::exit::{Exit, HasExit};
use crate::prompt;

const PASSWORD_TRIES: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(
        "permission denied for {user}@{host}.\n  tried: {tried}\n  the server accepts: {accepted}"
    )]
    Denied {
        user: String,
        host: String,
        tried: String,
        accepted: String,
    },
    #[error(
        "{user}@{host}: the server closed the connection during authentication \
         (tried: {tried}); too many keys offered (sshd MaxAuthTries)?"
    )]
    Closed {
        user: String,
        host: String,
        tried: String,
    },
}

impl HasExit for AuthError {
    fn exit(&self) -> Exit {
        Exit::Auth
    }
}

/// Record of what was attempted, for the failure message.
#[derive(Default)]
struct Attempts(Vec<String>);

impl Attempts {
    fn note(&mut self, what: impl Into<String>) {
        let what = what.into();
        tracing::debug!("auth: {what}");
        self.0.push(what);
    }
    fn summary(&self) -> String {
        if self.0.is_empty() {
            "nothing (no agent, no key files, no terminal for a password)".into()
        } else {
            self.0.join("; ")
        }
    }
}

struct Ctx<'a> {
    handle: &'a mut Handle,
    target: &'a Target,
    attempts: Attempts,
    accepted: Vec<MethodKind>,
    rsa_hash: Option<HashAlg>,
}

enum Step {
    Done,
    Continue,
}

impl Ctx<'_> {
    fn closed(&self) -> AuthError {
        AuthError::Closed {
            user: self.target.user.clone(),
            host: self.target.host_name.clone(),
            tried: self.attempts.summary(),
        }
    }

    /// Update what the server still accepts; `Done` on success.
    fn outcome(&mut self, r: AuthResult) -> Step {
        match r {
            AuthResult::Success => Step::Done,
            AuthResult::Failure {
                remaining_methods, ..
            } => {
                self.accepted = remaining_methods.iter().copied().collect();
                Step::Continue
            }
        }
    }

    fn accepts(&self, m: MethodKind) -> bool {
        self.accepted.contains(&m)
    }

    fn hash_for(&self, key: &PublicKey) -> Option<HashAlg> {
        if key.algorithm().is_rsa() {
            self.rsa_hash
        } else {
            None
        }
    }
}

/// Authenticate as `target.user`, or explain what was tried.
pub async fn authenticate(handle: &mut Handle, target: &Target) -> Result<(), AuthError> {
    let user = target.user.clone();
    let mut ctx = Ctx {
        handle,
        target,
        attempts: Attempts::default(),
        accepted: Vec::new(),
        rsa_hash: None,
    };

    // "none" tells us which methods the server offers (and rarely succeeds).
    let r = ctx
        .handle
        .authenticate_none(&user)
        .await
        .map_err(|_| ctx.closed())?;
    if let Step::Done = ctx.outcome(r) {
        return Ok(());
    }
    tracing::debug!("server accepts {:?}", ctx.accepted);
    ctx.rsa_hash = ctx
        .handle
        .best_supported_rsa_hash()
        .await
        .ok()
        .flatten()
        .flatten();

    let mut offered: Vec<PublicKey> = Vec::new();
    if target.pubkey_authentication && ctx.accepts(MethodKind::PublicKey) {
        if let Step::Done = try_agent(&mut ctx, &mut offered).await? {
            return Ok(());
        }
        if let Step::Done = try_key_files(&mut ctx, &offered).await? {
            return Ok(());
        }
    }
    if target.password_authentication && ctx.accepts(MethodKind::Password) {
        if let Step::Done = try_password(&mut ctx).await? {
            return Ok(());
        }
    }
    Err(AuthError::Denied {
        user,
        host: target.host_name.clone(),
        tried: ctx.attempts.summary(),
        accepted: if ctx.accepted.is_empty() {
            "nothing further".into()
        } else {
            ctx.accepted
                .iter()
                .map(<&str>::from)
                .collect::<Vec<_>>()
                .join(", ")
        },
    })
}

async fn try_agent(ctx: &mut Ctx<'_>, offered: &mut Vec<PublicKey>) -> Result<Step, AuthError> {
    let agent = match &ctx.target.identity_agent {
        AgentSocket::Disabled => return Ok(Step::Continue),
        AgentSocket::Env => {
            if std::env::var_os("SSH_AUTH_SOCK").is_none() {
                return Ok(Step::Continue);
            }
            AgentClient::connect_env().await.map(|a| a.dynamic())
        }
        AgentSocket::Path(p) => AgentClient::connect_uds(p).await.map(|a| a.dynamic()),
    };
    let mut agent = match agent {
        Ok(a) => a,
        Err(e) => {
            ctx.attempts.note(format!("ssh-agent unreachable ({e})"));
            return Ok(Step::Continue);
        }
    };
    let identities = match agent.request_identities().await {
        Ok(ids) => ids,
        Err(e) => {
            ctx.attempts
                .note(format!("ssh-agent failed to list keys ({e})"));
            return Ok(Step::Continue);
        }
    };
    // With IdentitiesOnly, only agent keys matching a configured file are used.
    let allowed: Option<Vec<PublicKey>> =
        (ctx.target.identities_only && ctx.target.identity_files_explicit).then(|| {
            ctx.target
                .identity_files
                .iter()
                .filter_map(|f| public_key_of(f))
                .collect()
        });
    let mut tried = 0usize;
    for id in identities {
        let AgentIdentity::PublicKey { key, comment } = id else {
            continue; // certificates: not supported yet
        };
        if let Some(allowed) = &allowed {
            if !allowed.iter().any(|a| a.key_data() == key.key_data()) {
                continue;
            }
        }
        if !ctx.accepts(MethodKind::PublicKey) {
            break;
        }
        tried += 1;
        let hash = ctx.hash_for(&key);
        let user = ctx.target.user.clone();
        match ctx
            .handle
            .authenticate_publickey_with(user, key.clone(), hash, &mut agent)
            .await
        {
            Ok(r) => {
                offered.push(key.clone());
                if let Step::Done = ctx.outcome(r) {
                    tracing::debug!("authenticated with agent key {comment}");
                    return Ok(Step::Done);
                }
            }
            Err(e) => {
                if ctx.handle.is_closed() {
                    return Err(ctx.closed());
                }
                tracing::debug!("agent key {comment}: {e}");
            }
        }
    }
    ctx.attempts.note(format!("ssh-agent ({tried} key(s))"));
    Ok(Step::Continue)
}

async fn try_key_files(ctx: &mut Ctx<'_>, offered: &[PublicKey]) -> Result<Step, AuthError> {
    let files = ctx.target.identity_files.clone();
    for path in files {
        if !ctx.accepts(MethodKind::PublicKey) {
            break;
        }
        if !path.exists() {
            if ctx.target.identity_files_explicit {
                ctx.attempts
                    .note(format!("key {} (no such file)", path.display()));
            }
            continue;
        }
        let Some(key) = load_key(ctx, &path).await else {
            continue;
        };
        if offered
            .iter()
            .any(|o| o.key_data() == key.public_key().key_data())
        {
            continue; // already tried through the agent
        }
        let hash = ctx.hash_for(key.public_key());
        let user = ctx.target.user.clone();
        let r = ctx
            .handle
            .authenticate_publickey(user, PrivateKeyWithHashAlg::new(Arc::new(key), hash))
            .await
            .map_err(|_| ctx.closed())?;
        ctx.attempts.note(format!("key {}", path.display()));
        if let Step::Done = ctx.outcome(r) {
            return Ok(Step::Done);
        }
    }
    Ok(Step::Continue)
}

/// Load a private key, asking for its passphrase on the terminal if needed.
async fn load_key(ctx: &mut Ctx<'_>, path: &Path) -> Option<PrivateKey> {
    match russh::keys::load_secret_key(path, None) {
        Ok(k) => return Some(k),
        Err(russh::keys::Error::KeyIsEncrypted) => {}
        Err(e) => {
            ctx.attempts
                .note(format!("key {} (unreadable: {e})", path.display()));
            return None;
        }
    }
    for _ in 0..PASSWORD_TRIES {
        let Some(pass) =
            prompt::secret(format!("Enter passphrase for key '{}': ", path.display())).await
        else {
            ctx.attempts.note(format!(
                "key {} (encrypted; no terminal to ask its passphrase)",
                path.display()
            ));
            return None;
        };
        match russh::keys::load_secret_key(path, Some(&pass)) {
            Ok(k) => return Some(k),
            Err(_) => eprintln!("Bad passphrase."),
        }
    }
    ctx.attempts
        .note(format!("key {} (wrong passphrase)", path.display()));
    None
}

async fn try_password(ctx: &mut Ctx<'_>) -> Result<Step, AuthError> {
    if !prompt::available() {
        ctx.attempts.note("password (not asked: no terminal)");
        return Ok(Step::Continue);
    }
    for _ in 0..PASSWORD_TRIES {
        let q = format!("{}@{}'s password: ", ctx.target.user, ctx.target.host_name);
        let Some(password) = prompt::secret(q).await else {
            break;
        };
        let user = ctx.target.user.clone();
        let r = ctx
            .handle
            .authenticate_password(user, password)
            .await
            .map_err(|_| ctx.closed())?;
        if let Step::Done = ctx.outcome(r) {
            return Ok(Step::Done);
        }
        eprintln!("Permission denied, please try again.");
        if !ctx.accepts(MethodKind::Password) {
            break;
        }
    }
    ctx.attempts.note("password");
    Ok(Step::Continue)
}

/// The public half of a key file: `FILE.pub`, else the unencrypted key itself.
fn public_key_of(path: &Path) -> Option<PublicKey> {
    let mut pub_path = path.as_os_str().to_owned();
    pub_path.push(".pub");
    russh::keys::load_public_key(&pub_path).ok().or_else(|| {
        russh::keys::load_secret_key(path, None)
            .ok()
            .map(|k| k.public_key().clone())
    })
}
