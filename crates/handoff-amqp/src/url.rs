//! Broker URLs: parsed into lapin's form, and shown without their credentials.
//!
//! lapin's own parser is used for everything it reads (vhost, query parameters, defaults), but
//! not for the host: it keeps only DNS names and turns an IP address into `localhost`, which
//! may then resolve to an address the broker does not listen on. Its messages for a URL that is
//! not hierarchical quote the URL, so those are replaced.

use std::path::Path;

use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use url::{Host, Url};

use crate::ConnectError;

/// A parsed broker URL.
pub(crate) struct BrokerUrl {
    /// What lapin connects to (credentials included).
    pub(crate) uri: AMQPUri,
    /// `scheme://host:port/vhost`, for messages and logs.
    pub(crate) shown: String,
    /// The CA certificates trusted for `amqps://` besides the public (webpki) roots.
    pub(crate) tls: OwnedTLSConfig,
}

// Hand-written so that a `{:?}` never prints the password.
impl std::fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerUrl")
            .field("shown", &self.shown)
            .finish_non_exhaustive()
    }
}

fn invalid(reason: impl Into<String>) -> ConnectError {
    ConnectError::InvalidUrl {
        reason: reason.into(),
    }
}

/// Parses `amqp[s]://[user[:password]@]host[:port][/vhost][?query]`; `heartbeat_secs` is asked
/// for unless the query sets `heartbeat`.
pub(crate) fn parse(url: &str, heartbeat_secs: u16) -> Result<BrokerUrl, ConnectError> {
    // `url`'s errors name the part that failed, never the input.
    let parsed = Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    if parsed.cannot_be_a_base() {
        return Err(invalid("the url is not of the form amqp://host"));
    }
    let host = match parsed.host() {
        Some(Host::Domain(name)) if !name.is_empty() => name.to_owned(),
        Some(Host::Ipv4(ip)) => ip.to_string(),
        Some(Host::Ipv6(ip)) => ip.to_string(),
        _ => return Err(invalid("the url has no host")),
    };
    let mut uri: AMQPUri = url.parse().map_err(|reason: String| {
        if reason.contains(url) {
            invalid("the url is malformed")
        } else {
            invalid(reason)
        }
    })?;
    uri.authority.host = host;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(heartbeat_secs);
    }
    let shown = show(&uri);
    Ok(BrokerUrl {
        uri,
        shown,
        tls: OwnedTLSConfig::default(),
    })
}

/// `url` that also trusts the CA certificates (PEM) in `ca`, for a broker whose certificate a
/// private CA signed.
///
/// # Errors
///
/// [`ConnectError::TlsCa`] when the URL is not `amqps://` (a CA for a plaintext connection is
/// a mistake, not a no-op), or the file cannot be read or holds no PEM certificate.
pub(crate) fn with_tls_ca(
    mut url: BrokerUrl,
    ca: Option<&Path>,
) -> Result<BrokerUrl, ConnectError> {
    let Some(ca) = ca else {
        return Ok(url);
    };
    let refused = |reason: String| ConnectError::TlsCa {
        path: ca.to_path_buf(),
        reason,
    };
    if url.uri.scheme != AMQPScheme::AMQPS {
        return Err(refused(format!(
            "a TLS CA is set but {} is not an amqps:// url",
            url.shown
        )));
    }
    let pem = std::fs::read_to_string(ca).map_err(|e| refused(format!("cannot be read: {e}")))?;
    // rustls skips what it cannot parse without a word: a file without a certificate would
    // only show up as "unknown issuer" at the handshake.
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(refused("holds no PEM certificate".to_owned()));
    }
    url.tls.cert_chain = Some(pem);
    Ok(url)
}

/// `scheme://host:port/vhost`: nothing of the URL that could be secret.
fn show(uri: &AMQPUri) -> String {
    let host = &uri.authority.host;
    let vhost = percent_encoding_vhost(&uri.vhost);
    if host.contains(':') {
        format!("{}://[{host}]:{}/{vhost}", uri.scheme, uri.authority.port)
    } else {
        format!("{}://{host}:{}/{vhost}", uri.scheme, uri.authority.port)
    }
}

fn percent_encoding_vhost(vhost: &str) -> String {
    vhost.replace('%', "%25").replace('/', "%2f")
}

/// `url` with its password replaced by `***`, for showing a configured URL (`Debug`, logs,
/// `--help`). A URL that does not parse is not shown at all.
///
/// # Examples
///
/// ```
/// assert_eq!(
///     handoff_amqp::redact_url("amqp://relay:s3cret@rabbit:5672/%2f"),
///     "amqp://relay:***@rabbit:5672/%2f"
/// );
/// assert_eq!(handoff_amqp::redact_url("amqp://rabbit"), "amqp://rabbit");
/// ```
pub fn redact(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() && parsed.set_password(Some("***")).is_err() {
                return "<unshowable url>".to_owned();
            }
            let shown = parsed.to_string();
            // `Url` adds a `/` to a URL without a path; keep the original's shape.
            if !url.ends_with('/') && shown.ends_with('/') && parsed.path() == "/" {
                shown[..shown.len() - 1].to_owned()
            } else {
                shown
            }
        }
        Err(_) => "<unparsable url>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConnectErrorKind;

    #[test]
    fn ip_hosts_are_kept_and_defaults_filled() {
        let parsed = parse("amqp://127.0.0.1", 10).unwrap();
        assert_eq!(parsed.uri.authority.host, "127.0.0.1");
        assert_eq!(parsed.uri.authority.port, 5672);
        assert_eq!(parsed.uri.vhost, "/");
        assert_eq!(parsed.uri.query.heartbeat, Some(10));
        assert_eq!(parsed.shown, "amqp://127.0.0.1:5672/%2f");
        let parsed = parse("amqps://[::1]:5671/prod?heartbeat=30", 10).unwrap();
        assert_eq!(parsed.uri.authority.host, "::1");
        assert_eq!(parsed.uri.query.heartbeat, Some(30));
        assert_eq!(parsed.shown, "amqps://[::1]:5671/prod");
    }

    #[test]
    fn credentials_are_read_and_never_shown() {
        let parsed = parse("amqp://relay:s%40cret@rabbit:5673/%2f", 10).unwrap();
        assert_eq!(parsed.uri.authority.userinfo.username, "relay");
        assert_eq!(parsed.uri.authority.userinfo.password, "s@cret");
        assert_eq!(parsed.uri.authority.host, "rabbit");
        assert_eq!(parsed.shown, "amqp://rabbit:5673/%2f");
        assert!(!format!("{parsed:?}").contains("cret"));
    }

    #[test]
    fn malformed_urls_are_invalid_and_not_echoed() {
        for bad in [
            "",
            "rabbit:5672",
            "http://u:secret@h",
            "amqp://u:secret@h:99999",
            "amqp://u:secret@h/?heartbeat=x",
            "mailto:u:secret@h",
            "amqp:///vhost",
        ] {
            let error = parse(bad, 10).unwrap_err();
            assert_eq!(error.kind(), ConnectErrorKind::InvalidUrl, "{bad:?}");
            assert!(!error.to_string().contains("secret"), "{error}");
        }
    }

    #[test]
    fn redact_hides_only_the_password() {
        assert_eq!(redact("amqp://u:pw@h:1/v"), "amqp://u:***@h:1/v");
        assert_eq!(redact("amqp://u@h"), "amqp://u@h");
        assert_eq!(redact("not a url secret"), "<unparsable url>");
    }
}
