//! Hostname canonicalization (CanonicalizeHostname, CanonicalDomains,
//! CanonicalizeMaxDots, CanonicalizeFallbackLocal), as ssh.c's
//! `resolve_canonicalize` does it, and the numeric form of an address
//! (which ssh applies whether or not canonicalization is on).

use std::net::{Ipv4Addr, Ipv6Addr, ToSocketAddrs};

use super::options::Options;
use super::parse::Canonicalize;

/// Looks names up (the system resolver; tests use a table).
pub(super) trait Resolver {
    fn resolves(&self, name: &str, port: u16) -> bool;
}

pub(super) struct System;

impl Resolver for System {
    fn resolves(&self, name: &str, port: u16) -> bool {
        tracing::debug!("canonicalization: looking up {name}");
        (name, port)
            .to_socket_addrs()
            .map(|mut a| a.next().is_some())
            .unwrap_or(false)
    }
}

/// What canonicalization did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Nothing to do, or no suffix resolved and falling back is allowed.
    Unchanged,
    Renamed(String),
    /// No suffix resolved and CanonicalizeFallbackLocal is no.
    NotFound,
}

/// ssh's `is_addr_fast`: looks like an address.
pub(super) fn looks_like_address(name: &str) -> bool {
    name.contains('%')
        || name.contains(':')
        || name.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// The numeric form of an address, as getaddrinfo(AI_NUMERICHOST) then
/// getnameinfo(NI_NUMERICHOST) give it (`127.1` is `127.0.0.1`), or `None`
/// when `name` is not an address.
pub(super) fn numeric_address(name: &str) -> Option<String> {
    if let Ok(v6) = name.parse::<Ipv6Addr>() {
        return Some(v6.to_string());
    }
    inet_aton(name).map(|v4| v4.to_string())
}

/// inet_aton(3): one to four parts, decimal, octal (leading 0) or hex (0x).
fn inet_aton(s: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let nums = parts
        .iter()
        .map(|p| {
            if p.is_empty() {
                None
            } else if let Some(hex) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
                if hex.is_empty() {
                    Some(0)
                } else {
                    u32::from_str_radix(hex, 16).ok()
                }
            } else if p.len() > 1 && p.starts_with('0') {
                u32::from_str_radix(&p[1..], 8).ok()
            } else {
                p.parse::<u32>().ok()
            }
        })
        .collect::<Option<Vec<u32>>>()?;
    let (last, head) = nums.split_last()?;
    if head.iter().any(|&n| n > 255) {
        return None;
    }
    let room = 32 - 8 * head.len() as u32;
    if room < 32 && *last >= (1u32 << room) {
        return None;
    }
    let mut v: u32 = 0;
    for (i, n) in head.iter().enumerate() {
        v |= n << (24 - 8 * i as u32);
    }
    Some(Ipv4Addr::from(v | last))
}

/// Canonicalize `host` (already lowercased, not an address) by the
/// options' rules.
pub(super) fn canonicalize(
    host: &str,
    port: u16,
    opts: &Options,
    resolver: &dyn Resolver,
) -> Outcome {
    let mode = opts.canonicalize_hostname.unwrap_or(Canonicalize::No);
    if mode == Canonicalize::No || looks_like_address(host) {
        return Outcome::Unchanged;
    }
    // A name a proxy or jump host will look up is left alone, unless asked.
    if !opts.direct() && mode != Canonicalize::Always {
        return Outcome::Unchanged;
    }
    let fallback = opts.canonicalize_fallback_local.unwrap_or(true);
    let not_found = || {
        if fallback {
            tracing::debug!("canonicalization: {host} not found in any suffix");
            Outcome::Unchanged
        } else {
            Outcome::NotFound
        }
    };
    if let Some(bare) = host.strip_suffix('.') {
        return if resolver.resolves(host, port) {
            Outcome::Renamed(bare.to_string())
        } else {
            not_found()
        };
    }
    let dots = host.bytes().filter(|&b| b == b'.').count();
    if dots > opts.canonicalize_max_dots.unwrap_or(1) as usize {
        return Outcome::Unchanged;
    }
    for domain in opts.canonical_domains.iter().flatten() {
        if domain.eq_ignore_ascii_case("none") {
            break;
        }
        let full = format!("{host}.{domain}.");
        if resolver.resolves(&full, port) {
            tracing::debug!("canonicalized hostname {host} => {host}.{domain}");
            return Outcome::Renamed(format!("{host}.{domain}"));
        }
    }
    not_found()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse::Setting;

    struct Table(&'static [&'static str]);
    impl Resolver for Table {
        fn resolves(&self, name: &str, _port: u16) -> bool {
            self.0.contains(&name)
        }
    }

    fn opts(settings: &[Setting]) -> Options {
        let mut o = Options::default();
        let origin = crate::config::options::Origin {
            path: "/cfg".into(),
            line: 1,
        };
        for s in settings {
            o.apply(s, true, &origin).expect("applies");
        }
        o
    }

    #[test]
    fn suffixes_in_order() {
        let table = Table(&["gpu.b.example.", "gpu.a.example."]);
        let o = opts(&[
            Setting::CanonicalizeHostname(Canonicalize::Yes),
            Setting::CanonicalDomains(vec![
                "c.example".into(),
                "b.example".into(),
                "a.example".into(),
            ]),
        ]);
        assert_eq!(
            canonicalize("gpu", 22, &o, &table),
            Outcome::Renamed("gpu.b.example".into())
        );
        assert_eq!(canonicalize("cpu", 22, &o, &table), Outcome::Unchanged);
        // More dots than CanonicalizeMaxDots (1): left alone.
        assert_eq!(canonicalize("a.b.c", 22, &o, &table), Outcome::Unchanged);
        let no_fallback = opts(&[
            Setting::CanonicalizeHostname(Canonicalize::Yes),
            Setting::CanonicalizeFallbackLocal(false),
            Setting::CanonicalDomains(vec!["x.example".into()]),
        ]);
        assert_eq!(
            canonicalize("cpu", 22, &no_fallback, &table),
            Outcome::NotFound
        );
    }

    #[test]
    fn proxied_names_only_with_always() {
        let table = Table(&["gpu.a.example."]);
        let jump = Setting::ProxyJump(crate::config::jump::parse("bastion").expect("parses"));
        let domains = Setting::CanonicalDomains(vec!["a.example".into()]);
        let yes = opts(&[
            jump.clone(),
            Setting::CanonicalizeHostname(Canonicalize::Yes),
            domains.clone(),
        ]);
        assert_eq!(canonicalize("gpu", 22, &yes, &table), Outcome::Unchanged);
        let always = opts(&[
            jump,
            Setting::CanonicalizeHostname(Canonicalize::Always),
            domains,
        ]);
        assert_eq!(
            canonicalize("gpu", 22, &always, &table),
            Outcome::Renamed("gpu.a.example".into())
        );
    }

    #[test]
    fn addresses() {
        assert_eq!(numeric_address("127.1").as_deref(), Some("127.0.0.1"));
        assert_eq!(numeric_address("10.0.0.1").as_deref(), Some("10.0.0.1"));
        assert_eq!(numeric_address("0177.0.0.1").as_deref(), Some("127.0.0.1"));
        assert_eq!(numeric_address("2130706433").as_deref(), Some("127.0.0.1"));
        assert_eq!(numeric_address("0:0::1").as_deref(), Some("::1"));
        assert_eq!(numeric_address("256.1.1.1"), None);
        assert_eq!(numeric_address("gpu"), None);
        assert!(looks_like_address("10.1"));
        assert!(looks_like_address("fe80::1%eth0"));
        assert!(!looks_like_address("gpu1"));
    }
}
