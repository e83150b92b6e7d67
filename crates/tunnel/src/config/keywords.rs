//! Every keyword OpenSSH's client knows that tunnel has no use for. Such a
//! line is accepted and has no effect; a keyword that is neither here nor
//! handled in `parse` is unknown, and unknown keywords make ssh refuse the
//! whole config (unless IgnoreUnknown names them), so they make tunnel
//! refuse it too.
//!
//! The list is OpenSSH 9.2's (readconf.c), the keywords added up to OpenSSH
//! 10, Debian's GSSAPI patch keywords, and Apple's `UseKeychain`, so that a
//! config a current ssh accepts is accepted here.

/// Lowercase keywords, sorted.
const IGNORED: &[&str] = &[
    "addkeystoagent",
    "afstokenpassing",
    "batchmode",
    "casignaturealgorithms",
    "channeltimeout",
    "cipher",
    "ciphers",
    "clearallforwardings",
    "compression",
    "compressionlevel",
    "connectionattempts",
    "controlmaster",
    "controlpath",
    "controlpersist",
    "dynamicforward",
    "enableescapecommandline",
    "enablesshkeysign",
    "escapechar",
    "exitonforwardfailure",
    "fallbacktorsh",
    "fingerprinthash",
    "forkafterauthentication",
    "forwardagent",
    "forwardx11",
    "forwardx11timeout",
    "forwardx11trusted",
    "gatewayports",
    "globalknownhostsfile2",
    "gssapiauthentication",
    "gssapiclientidentity",
    "gssapidelegatecredentials",
    "gssapikexalgorithms",
    "gssapikeyexchange",
    "gssapirenewalforcesrekey",
    "gssapiserveridentity",
    "gssapitrustdns",
    "hostbasedacceptedalgorithms",
    "hostbasedauthentication",
    "hostbasedkeytypes",
    "hostkeyalgorithms",
    "ipqos",
    "kbdinteractivedevices",
    "keepalive",
    "kerberosauthentication",
    "kerberostgtpassing",
    "kexalgorithms",
    "localcommand",
    "localforward",
    "loglevel",
    "logverbose",
    "macs",
    "nohostauthenticationforlocalhost",
    "numberofpasswordprompts",
    "obscurekeystroketiming",
    "permitlocalcommand",
    "permitremoteopen",
    "preferredauthentications",
    "protocol",
    "proxyusefdpass",
    "pubkeyacceptedalgorithms",
    "pubkeyacceptedkeytypes",
    "refuseconnection",
    "rekeylimit",
    "remotecommand",
    "remoteforward",
    "requestty",
    "requiredrsasize",
    "rhostsauthentication",
    "rhostsrsaauthentication",
    "rsaauthentication",
    "sendenv",
    "sessiontype",
    "setenv",
    "smartcarddevice",
    "stdinnull",
    "streamlocalbindmask",
    "streamlocalbindunlink",
    "syslogfacility",
    "tag",
    "tcpkeepalive",
    "tunnel",
    "tunneldevice",
    "updatehostkeys",
    "usekeychain",
    "useprivilegedport",
    "userknownhostsfile2",
    "useroaming",
    "usersh",
    "verifyhostkeydns",
    "versionaddendum",
    "visualhostkey",
    "warnweakcrypto",
    "xauthlocation",
];

/// Whether `keyword` (lowercase) is an OpenSSH keyword tunnel ignores.
pub(super) fn ignored(keyword: &str) -> bool {
    IGNORED.binary_search(&keyword).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_lowercase_and_unique() {
        let mut sorted = IGNORED.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, IGNORED);
        assert!(IGNORED.iter().all(|k| k
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())));
        assert!(ignored("forwardagent"));
        assert!(!ignored("hostname"));
        assert!(!ignored("stricthostkeycheking"));
    }
}
