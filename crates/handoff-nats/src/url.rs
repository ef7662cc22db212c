//! Server URLs: parsed, stripped of credentials, and shown without them.
//!
//! async-nats does not read credentials from a server URL, so they are taken out here (the NATS
//! convention: `user:password@` is a user and password, a lone `token@` is a token) and handed to
//! the client as options. The addresses the client gets carry no credentials, so its own logs
//! cannot print them either.

use std::borrow::Cow;
use std::str::FromStr;

use async_nats::ServerAddr;
use percent_encoding::percent_decode_str;

use crate::ConnectError;

/// How the client authenticates, as found in the URL.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Credentials {
    /// `nats://user:password@host`.
    UserPassword { user: String, password: String },
    /// `nats://token@host`.
    Token(String),
}

// Hand-written so that a `{:?}` of the parsed URL never prints a secret.
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UserPassword { user, .. } => write!(f, "UserPassword({user:?}, ***)"),
            Self::Token(_) => write!(f, "Token(***)"),
        }
    }
}

/// A comma-separated list of server URLs, split into addresses and credentials.
#[derive(Debug)]
pub(crate) struct ServerUrls {
    /// The servers, without credentials.
    pub(crate) servers: Vec<ServerAddr>,
    /// The servers as `scheme://host:port`, comma-separated, for messages.
    pub(crate) shown: String,
    /// The credentials every server in the list carries, if any.
    pub(crate) credentials: Option<Credentials>,
}

fn invalid(reason: impl Into<String>) -> ConnectError {
    ConnectError::InvalidUrl {
        reason: reason.into(),
    }
}

/// Parses `nats://[user:password@|token@]host[:port]`, or several of them separated by commas.
/// The scheme may be left out (`nats://` is assumed) and the port too (4222).
pub(crate) fn parse(urls: &str) -> Result<ServerUrls, ConnectError> {
    let mut servers = Vec::new();
    let mut shown = Vec::new();
    let mut credentials: Option<Option<Credentials>> = None;
    for part in urls.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(invalid(
                "the url (or an entry of the comma-separated list) is empty",
            ));
        }
        // async-nats's messages name the part that failed (scheme, port) but not the URL.
        let addr = ServerAddr::from_str(part).map_err(|e| invalid(e.to_string()))?;
        if addr.host().is_empty() {
            return Err(invalid("the url has no host"));
        }
        let found = credentials_of(&addr)?;
        match &credentials {
            None => credentials = Some(found),
            Some(previous) if *previous == found => {}
            Some(_) => {
                return Err(invalid(
                    "the servers of the list carry different credentials; give them once, \
                     on every entry alike",
                ))
            }
        }
        shown.push(show(&addr));
        servers.push(strip_credentials(addr)?);
    }
    Ok(ServerUrls {
        servers,
        shown: shown.join(","),
        credentials: credentials.flatten(),
    })
}

fn credentials_of(addr: &ServerAddr) -> Result<Option<Credentials>, ConnectError> {
    let decode = |s: &str| -> Result<String, ConnectError> {
        percent_decode_str(s)
            .decode_utf8()
            .map(Cow::into_owned)
            .map_err(|_| invalid("the url's credentials are not percent-encoded UTF-8"))
    };
    Ok(match (addr.username(), addr.password()) {
        (None, None) => None,
        (Some(user), Some(password)) => Some(Credentials::UserPassword {
            user: decode(user)?,
            password: decode(password)?,
        }),
        (Some(token), None) => Some(Credentials::Token(decode(token)?)),
        (None, Some(_)) => return Err(invalid("the url has a password but no user")),
    })
}

fn strip_credentials(addr: ServerAddr) -> Result<ServerAddr, ConnectError> {
    let mut url = addr.into_inner();
    // Both only fail for URLs that cannot have a host, which `ServerAddr` already refused.
    let cleared = url.set_username("").is_ok() && url.set_password(None).is_ok();
    if !cleared {
        return Err(invalid("the url's credentials cannot be separated from it"));
    }
    ServerAddr::from_url(url).map_err(|e| invalid(e.to_string()))
}

/// `scheme://host:port`: nothing of the URL that could be secret.
fn show(addr: &ServerAddr) -> String {
    let host = addr.host();
    if host.contains(':') {
        format!("{}://[{host}]:{}", addr.scheme(), addr.port())
    } else {
        format!("{}://{host}:{}", addr.scheme(), addr.port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConnectErrorKind;

    #[test]
    fn plain_urls_parse_with_defaults() {
        let parsed = parse("127.0.0.1").unwrap();
        assert_eq!(parsed.shown, "nats://127.0.0.1:4222");
        assert_eq!(parsed.credentials, None);
        let parsed = parse("nats://a:1, tls://b:2").unwrap();
        assert_eq!(parsed.shown, "nats://a:1,tls://b:2");
        assert_eq!(parsed.servers.len(), 2);
        assert_eq!(
            parse("nats://[::1]:4222").unwrap().shown,
            "nats://[::1]:4222"
        );
    }

    #[test]
    fn credentials_are_taken_out_of_the_url() {
        let parsed = parse("nats://alice:s%40cret@h:4222").unwrap();
        assert_eq!(
            parsed.credentials,
            Some(Credentials::UserPassword {
                user: "alice".into(),
                password: "s@cret".into()
            })
        );
        assert_eq!(parsed.shown, "nats://h:4222");
        let connect_url = parsed.servers[0].as_url_str();
        assert!(!connect_url.contains("alice") && !connect_url.contains("cret"));
        assert!(!format!("{parsed:?}").contains("cret"));

        let parsed = parse("nats://t0k3n@h").unwrap();
        assert_eq!(parsed.credentials, Some(Credentials::Token("t0k3n".into())));
        assert!(!format!("{parsed:?}").contains("t0k3n"));
    }

    #[test]
    fn malformed_urls_are_invalid_and_not_echoed() {
        for bad in [
            "",
            "nats://a,,nats://b",
            "http://h:4222",
            "nats://u:secret@h:99999",
            "nats://:secret@h",
            "nats://u:secret@h,nats://other@h2",
        ] {
            let error = parse(bad).unwrap_err();
            assert_eq!(error.kind(), ConnectErrorKind::InvalidUrl, "{bad:?}");
            assert!(!error.to_string().contains("secret"), "{error}");
        }
    }
}
