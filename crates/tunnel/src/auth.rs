//! User authentication, in ssh's order: agent, key files,
//! keyboard-interactive (2FA prompts), then password.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use russh::client::{AuthResult, KeyboardInteractiveAuthResponse};
use russh::keys::agent::AgentIdentity;
use russh::keys::ssh_key::PublicKey;
use russh::keys::{HashAlg, PrivateKey, PrivateKeyWithHashAlg};
use russh::MethodKind;

use crate::config::Target;
use crate::connect::Handle;
use crate::exit::{Exit, HasExit};
use crate::prompt;
use crate::sanitize;

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
                remaining_methods,
                partial_success,
            } => {
                if partial_success {
                    tracing::debug!("partial success; the server asks for more");
                }
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
    // After a key, the server may still ask for a code (AuthenticationMethods
    // publickey,keyboard-interactive): "partial success" leaves only this.
    if target.kbd_interactive_authentication && ctx.accepts(MethodKind::KeyboardInteractive) {
        if let Step::Done = try_keyboard_interactive(&mut ctx).await? {
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
    // A Unix socket, or on Windows OpenSSH's agent pipe (else Pageant).
    let mut agent = match crate::platform::connect_agent(&ctx.target.identity_agent).await {
        Ok(Some(a)) => a,
        Ok(None) => return Ok(Step::Continue),
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
    // With IdentitiesOnly, only agent keys matching an identity file are used:
    // the configured ones, or OpenSSH's default files when none is configured.
    let allowed: Option<Vec<PublicKey>> = ctx.target.identities_only.then(|| {
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

/// Keys decrypted with a passphrase typed in this process, by file: a
/// reconnect (after a network drop, nobody may be at the terminal) must not
/// ask again. Only the decrypted key is kept, in this process's memory, as
/// ssh-agent would; the passphrase itself is dropped at once.
fn unlocked_keys() -> &'static Mutex<HashMap<PathBuf, PrivateKey>> {
    static KEYS: OnceLock<Mutex<HashMap<PathBuf, PrivateKey>>> = OnceLock::new();
    KEYS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Load a private key, asking for its passphrase on the terminal if needed
/// (once per process: see [`unlocked_keys`]).
async fn load_key(ctx: &mut Ctx<'_>, path: &Path) -> Option<PrivateKey> {
    if let Some(k) = unlocked_keys()
        .lock()
        .ok()
        .and_then(|m| m.get(path).cloned())
    {
        tracing::debug!("key {}: passphrase given earlier", path.display());
        return Some(k);
    }
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
            Ok(k) => {
                if let Ok(mut m) = unlocked_keys().lock() {
                    m.insert(path.to_path_buf(), k.clone());
                }
                return Some(k);
            }
            Err(_) => eprintln!("Bad passphrase."),
        }
    }
    ctx.attempts
        .note(format!("key {} (wrong passphrase)", path.display()));
    None
}

/// Keyboard-interactive: show the server's prompts as sent (name,
/// instructions, each prompt), read the answers at the terminal, hidden
/// where the server says echo is off (a one-time code, a PIN). Answers are
/// never kept: a one-time code is useless on a reconnect.
async fn try_keyboard_interactive(ctx: &mut Ctx<'_>) -> Result<Step, AuthError> {
    if !prompt::available() {
        ctx.attempts
            .note("keyboard-interactive (not asked: no terminal for the server's prompts)");
        return Ok(Step::Continue);
    }
    let mut refused = 0usize;
    for _ in 0..PASSWORD_TRIES {
        let user = ctx.target.user.clone();
        let mut reply = ctx
            .handle
            .authenticate_keyboard_interactive_start(user, None)
            .await
            .map_err(|_| ctx.closed())?;
        // A server may send any number of rounds, some with no prompts.
        loop {
            match reply {
                KeyboardInteractiveAuthResponse::Success => {
                    tracing::debug!("authenticated with keyboard-interactive");
                    return Ok(Step::Done);
                }
                KeyboardInteractiveAuthResponse::Failure {
                    remaining_methods, ..
                } => {
                    ctx.accepted = remaining_methods.iter().copied().collect();
                    break;
                }
                KeyboardInteractiveAuthResponse::InfoRequest {
                    name,
                    instructions,
                    prompts,
                } => {
                    // All three are the server's text: shown with terminal
                    // controls escaped, as ssh shows them.
                    for text in [&name, &instructions] {
                        if !text.is_empty() {
                            eprintln!("{}", sanitize::for_terminal(text.trim_end()));
                        }
                    }
                    let mut answers = Vec::with_capacity(prompts.len());
                    for p in prompts {
                        let question = sanitize::for_terminal(&p.prompt);
                        let answer = if p.echo {
                            prompt::ask(question)
                                .await
                                .map(|a| a.trim_end_matches(['\r', '\n']).to_string())
                        } else {
                            prompt::secret(question).await
                        };
                        let Some(answer) = answer else {
                            ctx.attempts
                                .note("keyboard-interactive (no answer read at the terminal)");
                            return Ok(Step::Continue);
                        };
                        answers.push(answer);
                    }
                    reply = ctx
                        .handle
                        .authenticate_keyboard_interactive_respond(answers)
                        .await
                        .map_err(|_| ctx.closed())?;
                }
            }
        }
        refused += 1;
        if !ctx.accepts(MethodKind::KeyboardInteractive) {
            break;
        }
        eprintln!("Permission denied, please try again.");
    }
    ctx.attempts.note(format!(
        "keyboard-interactive (the server refused the answers {refused} time(s))"
    ));
    Ok(Step::Continue)
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
