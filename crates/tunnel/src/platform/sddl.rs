//! Security descriptors in SDDL text form (what
//! `ConvertSecurityDescriptorToStringSecurityDescriptorW` returns): who a
//! DACL lets in. Pure string code, so the rules are tested on every
//! platform; `windows.rs` feeds it the descriptors of real files.

/// A descriptor that is not SDDL as Windows writes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SddlError {
    /// The whole descriptor.
    #[error("bad security descriptor {0:?}")]
    Descriptor(String),
    /// The DACL part with an ACE outside parentheses.
    #[error("bad ACE in {0:?}")]
    Ace(String),
    /// An ACE with fewer than six fields, and its DACL part.
    #[error("bad ACE ({ace}) in {part:?}")]
    ShortAce { ace: String, part: String },
}

/// Why a config file's descriptor is not safe, as OpenSSH for Windows
/// judges it; shown inside windows.rs's "bad owner or permissions" text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InsecureConfig {
    #[error(transparent)]
    Unreadable(#[from] SddlError),
    /// Owned by this SID (not the user, SYSTEM or Administrators).
    #[error("it is owned by {0}")]
    Owner(String),
    #[error("its owner is unknown")]
    NoOwner,
    #[error("it has no access control list (anyone may write it)")]
    NoDacl,
    /// An allow ACE that lets someone else write.
    #[error("{sid} may write it ({rights})")]
    Writable { sid: String, rights: String },
}

/// One ACE: `(type;flags;rights;object;inherit-object;sid)`.
#[derive(Debug, PartialEq, Eq)]
pub struct Ace<'a> {
    pub kind: &'a str,
    pub flags: &'a str,
    pub rights: &'a str,
    pub sid: &'a str,
}

/// The owner (`O:`) and DACL (`D:`) of a descriptor; `None` for a part it
/// lacks. `dacl` is `None` also for a NULL DACL (`D:NO_ACCESS_CONTROL`,
/// everyone may do anything).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Descriptor<'a> {
    pub owner: Option<&'a str>,
    pub dacl: Option<Vec<Ace<'a>>>,
}

pub fn parse(text: &str) -> Result<Descriptor<'_>, SddlError> {
    let bad = || SddlError::Descriptor(text.to_string());
    let mut d = Descriptor::default();
    let mut rest = text;
    while !rest.is_empty() {
        let (tag, body) = rest.split_at_checked(2).ok_or_else(bad)?;
        // A part runs to the next `X:` tag outside parentheses.
        let mut depth = 0usize;
        let mut end = body.len();
        for (i, c) in body.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ if depth == 0
                    && body[i..].len() >= 2
                    && matches!(&body[i..i + 2], "O:" | "G:" | "D:" | "S:") =>
                {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        let (part, next) = body.split_at(end);
        match tag {
            "O:" => d.owner = Some(part),
            "D:" => d.dacl = dacl(part)?,
            "G:" | "S:" => {}
            _ => return Err(bad()),
        }
        rest = next;
    }
    Ok(d)
}

fn dacl(part: &str) -> Result<Option<Vec<Ace<'_>>>, SddlError> {
    let Some(open) = part.find('(') else {
        // Flags only: an empty DACL (no one) unless it says NO_ACCESS_CONTROL.
        return Ok((!part.contains("NO_ACCESS_CONTROL")).then(Vec::new));
    };
    if part[..open].contains("NO_ACCESS_CONTROL") {
        return Ok(None);
    }
    let mut aces = Vec::new();
    for chunk in part[open..].split(')').filter(|c| !c.is_empty()) {
        let inner = chunk
            .strip_prefix('(')
            .ok_or_else(|| SddlError::Ace(part.to_string()))?;
        let fields: Vec<&str> = inner.split(';').collect();
        if fields.len() < 6 {
            return Err(SddlError::ShortAce {
                ace: inner.to_string(),
                part: part.to_string(),
            });
        }
        aces.push(Ace {
            kind: fields[0],
            flags: fields[1],
            rights: fields[2],
            sid: fields[5],
        });
    }
    Ok(Some(aces))
}

/// The DACL tunnel gives its private files and directories: protected (the
/// parent's entries do not apply) with one entry, full control for `user_sid`;
/// a directory's entry is inherited by what is created in it.
pub fn owner_only_dacl(user_sid: &str, dir: bool) -> String {
    let inherit = if dir { "OICI" } else { "" };
    format!("D:P(A;{inherit};FA;;;{user_sid})")
}

#[cfg_attr(not(test), allow(dead_code))]
/// Whether only `user_sid` is let in: a DACL exists and every allow ACE
/// names that SID. (Deny ACEs only take away.)
pub fn owner_only(text: &str, user_sid: &str) -> Result<bool, SddlError> {
    let d = parse(text)?;
    Ok(match d.dacl {
        None => false,
        Some(aces) => aces
            .iter()
            .filter(|a| matches!(a.kind, "A" | "OA" | "XA" | "ZA"))
            .all(|a| a.sid == user_sid),
    })
}

/// OpenSSH for Windows' `check_secure_file_permission` for a config file:
/// owned by the user, SYSTEM or Administrators, and writable by no one
/// else. `Err` says what is wrong.
pub fn config_file_secure(text: &str, user_sid: &str) -> Result<(), InsecureConfig> {
    let d = parse(text)?;
    let trusted = |sid: &str| sid == user_sid || sid == "SY" || sid == "BA";
    match d.owner {
        Some(o) if trusted(o) => {}
        Some(o) => return Err(InsecureConfig::Owner(o.to_string())),
        None => return Err(InsecureConfig::NoOwner),
    }
    let Some(aces) = d.dacl else {
        return Err(InsecureConfig::NoDacl);
    };
    for a in aces.iter().filter(|a| a.kind == "A") {
        if a.flags.contains("IO") {
            continue; // inherit-only: not about this file
        }
        if !trusted(a.sid) && grants_write(a.rights) {
            return Err(InsecureConfig::Writable {
                sid: a.sid.to_string(),
                rights: a.rights.to_string(),
            });
        }
    }
    Ok(())
}

/// Whether an SDDL rights string allows changing the file or its ACL.
fn grants_write(rights: &str) -> bool {
    // FILE_WRITE_DATA, FILE_APPEND_DATA, FILE_WRITE_EA, FILE_WRITE_ATTRIBUTES,
    // DELETE, WRITE_DAC, WRITE_OWNER, GENERIC_ALL, GENERIC_WRITE.
    const WRITE_BITS: u32 =
        0x2 | 0x4 | 0x10 | 0x100 | 0x1_0000 | 0x4_0000 | 0x8_0000 | 0x1000_0000 | 0x4000_0000;
    if let Some(hex) = rights
        .strip_prefix("0x")
        .or_else(|| rights.strip_prefix("0X"))
    {
        return u32::from_str_radix(hex, 16).map_or(true, |m| m & WRITE_BITS != 0);
    }
    let bytes = rights.as_bytes();
    bytes.chunks(2).any(|c| {
        matches!(
            c,
            b"GA" | b"GW" | b"FA" | b"FW" | b"WD" | b"WO" | b"SD" | b"KA" | b"KW" | b"WP" | b"CC"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "S-1-5-21-1-2-3-1001";

    #[test]
    fn parses_owner_and_aces() {
        let d = parse("O:S-1-5-21-1-2-3-1001G:SYD:P(A;OICI;FA;;;S-1-5-21-1-2-3-1001)(A;;FR;;;WD)")
            .expect("parses");
        assert_eq!(d.owner, Some(ME));
        let aces = d.dacl.expect("dacl");
        assert_eq!(aces.len(), 2);
        assert_eq!(aces[0].flags, "OICI");
        assert_eq!(aces[1].sid, "WD");
    }

    #[test]
    fn the_dacl_tunnel_sets_is_owner_only() {
        for dir in [true, false] {
            let text = owner_only_dacl(ME, dir);
            assert!(owner_only(&text, ME).unwrap(), "{text}");
            assert!(!owner_only(&text, "S-1-5-21-1-2-3-1002").unwrap(), "{text}");
            assert!(text.starts_with("D:P("), "protected: {text}");
        }
        assert_eq!(owner_only_dacl(ME, true), format!("D:P(A;OICI;FA;;;{ME})"));
    }

    #[test]
    fn owner_only_means_every_allow_ace_is_the_user() {
        assert!(owner_only(&format!("D:P(A;OICI;FA;;;{ME})"), ME).unwrap());
        assert!(owner_only(&format!("D:AI(A;ID;FA;;;{ME})"), ME).unwrap());
        assert!(owner_only(&format!("D:P(D;;FA;;;WD)(A;;FA;;;{ME})"), ME).unwrap());
        assert!(!owner_only(&format!("D:P(A;;FA;;;{ME})(A;;FR;;;BU)"), ME).unwrap());
        assert!(!owner_only("D:NO_ACCESS_CONTROL", ME).unwrap());
        // An empty DACL lets no one in: private, if useless.
        assert!(owner_only("D:P", ME).unwrap());
    }

    #[test]
    fn config_files_follow_openssh_for_windows() {
        let ok = format!("O:{ME}D:(A;;FA;;;SY)(A;;FA;;;BA)(A;;FA;;;{ME})(A;;0x1200a9;;;BU)");
        assert_eq!(config_file_secure(&ok, ME), Ok(()));
        assert!(config_file_secure(&format!("O:BAD:(A;;FA;;;{ME})"), ME).is_ok());
        let other_owner = "O:S-1-5-21-9-9-9-1002D:(A;;FA;;;SY)";
        let why = |text: &str| config_file_secure(text, ME).unwrap_err().to_string();
        assert_eq!(why(other_owner), "it is owned by S-1-5-21-9-9-9-1002");
        let users_write = format!("O:{ME}D:(A;;FA;;;{ME})(A;;0x1301bf;;;BU)");
        assert_eq!(why(&users_write), "BU may write it (0x1301bf)");
        assert_eq!(why("D:(A;;FA;;;SY)"), "its owner is unknown");
        let everyone_modify = format!("O:{ME}D:(A;;FRFW;;;WD)");
        assert!(config_file_secure(&everyone_modify, ME).is_err());
        let inherit_only = format!("O:{ME}D:(A;OICIIO;FA;;;CO)(A;;FA;;;{ME})");
        assert!(config_file_secure(&inherit_only, ME).is_ok());
        assert_eq!(
            why(&format!("O:{ME}D:NO_ACCESS_CONTROL")),
            "it has no access control list (anyone may write it)"
        );
        // A descriptor that cannot be read says what it is.
        assert_eq!(why("X"), "bad security descriptor \"X\"");
        assert_eq!(why("D:(A;;FA;;;WD)X)"), "bad ACE in \"(A;;FA;;;WD)X)\"");
        assert_eq!(why("D:(A;;FA)"), "bad ACE (A;;FA) in \"(A;;FA)\"");
    }
}
