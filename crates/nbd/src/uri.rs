//! NBD addresses, as the NBD URI convention writes them (the subset a
//! disk needs): `nbd://HOST[:PORT]/EXPORT` (plaintext TCP, port 10809 by
//! default), `nbds://HOST[:PORT]/EXPORT` (TLS with ferry's certificates),
//! `nbd+unix:///EXPORT?socket=PATH` (a Unix socket on this host). The
//! export name may be empty (the server's default export).

use std::path::PathBuf;

use crate::error::NbdError;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;
/// The longest export name the protocol allows (the spec's limit).
pub const MAX_EXPORT_NAME: usize = 4096;

/// How to reach the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `HOST:PORT` over TCP; `tls`: STARTTLS before anything else.
    Tcp {
        /// `HOST:PORT`.
        hostport: String,
        /// `nbds://`.
        tls: bool,
    },
    /// A Unix socket.
    Unix(PathBuf),
}

/// A parsed NBD address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    /// How to reach the server.
    pub transport: Transport,
    /// The export's name.
    pub export: String,
}

impl NbdUri {
    /// Parses `s` (see the module's header).
    pub fn parse(s: &str) -> Result<NbdUri, NbdError> {
        let bad = || NbdError::BadUri(s.to_string());
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            // nbd+unix:///EXPORT?socket=PATH (no host).
            let rest = rest.strip_prefix('/').ok_or_else(bad)?;
            let (export, query) = rest.split_once('?').ok_or_else(bad)?;
            let path = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|p| !p.is_empty())
                .ok_or_else(bad)?;
            return Ok(NbdUri {
                transport: Transport::Unix(PathBuf::from(path)),
                export: export_name(export).ok_or_else(bad)?,
            });
        }
        let (tls, rest) = match (s.strip_prefix("nbds://"), s.strip_prefix("nbd://")) {
            (Some(r), _) => (true, r),
            (None, Some(r)) => (false, r),
            _ => return Err(bad()),
        };
        let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() || authority.contains(['?', '#', '@']) {
            return Err(bad());
        }
        let hostport = match authority.rsplit_once(':') {
            // [v6]:port, host:port
            Some((host, port)) if !host.is_empty() && !port.contains(']') => {
                port.parse::<u16>().map_err(|_| bad())?;
                authority.to_string()
            }
            _ => format!("{authority}:{DEFAULT_PORT}"),
        };
        Ok(NbdUri {
            transport: Transport::Tcp { hostport, tls },
            export: export_name(export).ok_or_else(bad)?,
        })
    }

    /// The address for messages.
    pub fn describe(&self) -> String {
        match &self.transport {
            Transport::Tcp { hostport, tls } => format!(
                "{}://{hostport}/{}",
                if *tls { "nbds" } else { "nbd" },
                self.export
            ),
            Transport::Unix(p) => format!("nbd+unix:///{}?socket={}", self.export, p.display()),
        }
    }
}

/// An export name from a URI's path: no query or fragment, within the
/// protocol's limit.
fn export_name(s: &str) -> Option<String> {
    (s.len() <= MAX_EXPORT_NAME && !s.contains(['?', '#', '\0'])).then(|| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(hostport: &str, tls: bool, export: &str) -> NbdUri {
        NbdUri {
            transport: Transport::Tcp {
                hostport: hostport.into(),
                tls,
            },
            export: export.into(),
        }
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(
            NbdUri::parse("nbd://10.0.0.1/disk").unwrap(),
            tcp("10.0.0.1:10809", false, "disk")
        );
        assert_eq!(
            NbdUri::parse("nbds://store:10900/vm/disk0").unwrap(),
            tcp("store:10900", true, "vm/disk0")
        );
        assert_eq!(
            NbdUri::parse("nbd://[::1]:7000/").unwrap(),
            tcp("[::1]:7000", false, "")
        );
        assert_eq!(
            NbdUri::parse("nbd://[::1]").unwrap(),
            tcp("[::1]:10809", false, "")
        );
        assert_eq!(
            NbdUri::parse("nbd+unix:///d?socket=/run/nbd.sock").unwrap(),
            NbdUri {
                transport: Transport::Unix("/run/nbd.sock".into()),
                export: "d".into()
            }
        );
    }

    #[test]
    fn bad_addresses_are_refused() {
        for s in [
            "",
            "nbd:/x",
            "http://h/x",
            "nbd:///x",
            "nbd://h:notaport/x",
            "nbd://h:70000/x",
            "nbd://user@h/x",
            "nbd://h/x?y",
            "nbd+unix:///x",
            "nbd+unix:///x?socket=",
        ] {
            assert!(
                matches!(NbdUri::parse(s), Err(NbdError::BadUri(_))),
                "{s:?}"
            );
        }
        let long = format!("nbd://h/{}", "a".repeat(MAX_EXPORT_NAME + 1));
        assert!(NbdUri::parse(&long).is_err());
    }

    #[test]
    fn an_address_describes_itself_as_written() {
        for s in [
            "nbd://h:10809/x",
            "nbds://h:1/",
            "nbd+unix:///e?socket=/tmp/s",
        ] {
            assert_eq!(NbdUri::parse(s).unwrap().describe(), s);
        }
    }
}
