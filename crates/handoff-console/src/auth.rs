//! Who is asking: bearer tokens (`name:token` lines, the name is the actor), the console's own
//! session cookie (signed in with a token), or a trusted reverse proxy's user header. Nothing
//! else gets in.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;

use axum::http::{header, HeaderMap};
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::config::ConsoleConfig;
use crate::ConsoleError;

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "handoff_console_session";

/// Bearer tokens by the name their holder acts under.
#[derive(Clone, Default)]
pub struct Tokens {
    /// SHA-256 of each token, with its name: compared digest to digest, so the comparison's
    /// time says nothing about the token.
    by_digest: Vec<([u8; 32], String)>,
}

impl std::fmt::Debug for Tokens {
    // Never the tokens, not even their digests.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.by_digest.iter().map(|(_, n)| n.as_str()).collect();
        f.debug_struct("Tokens").field("names", &names).finish()
    }
}

impl Tokens {
    /// Parses a token file: one `name:token` a line; blank lines and `#` comments are skipped.
    ///
    /// # Errors
    ///
    /// [`ConsoleError::TokenFile`] for a line that is not `name:token`.
    ///
    /// # Examples
    ///
    /// ```
    /// let tokens = handoff_console::Tokens::parse("# operators\nalice:s3cret\n").unwrap();
    /// assert_eq!(tokens.actor("s3cret"), Some("alice"));
    /// assert_eq!(tokens.actor("guess"), None);
    /// ```
    pub fn parse(text: &str) -> Result<Self, ConsoleError> {
        let mut by_digest = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, token) = line
                .split_once(':')
                .map(|(n, t)| (n.trim(), t.trim()))
                .filter(|(n, t)| !n.is_empty() && !t.is_empty())
                .ok_or(ConsoleError::TokenFile { line: index + 1 })?;
            by_digest.push((digest(token), name.to_owned()));
        }
        Ok(Self { by_digest })
    }

    /// Whether there is no token at all.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The name `token` belongs to.
    pub fn actor(&self, token: &str) -> Option<&str> {
        let wanted = digest(token);
        self.by_digest
            .iter()
            .find(|(d, _)| constant_time_eq(d, &wanted))
            .map(|(_, name)| name.as_str())
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How a request proved who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Credential {
    /// `Authorization: Bearer`: a browser never sends it on its own, so forms posted with it
    /// cannot be forged cross-site.
    Bearer,
    /// The console's session cookie, with the session's id.
    Session(String),
    /// A trusted proxy's header.
    Proxy,
}

/// Who is asking, and how they proved it.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    /// The actor actions are audited under.
    pub actor: String,
    /// How.
    pub credential: Credential,
}

impl Identity {
    /// What the anti-forgery token is bound to: the session, or the proxied user.
    pub fn csrf_subject(&self) -> String {
        match &self.credential {
            Credential::Session(id) => format!("session:{id}"),
            Credential::Proxy => format!("proxy:{}", self.actor),
            Credential::Bearer => format!("bearer:{}", self.actor),
        }
    }
}

/// Sessions signed in through the login form, in memory: a console restart signs everybody
/// out, which is fine for an operator's tool. std Mutex: never held across `.await`.
#[derive(Default)]
pub(crate) struct Sessions {
    by_id: Mutex<HashMap<String, String>>,
}

impl Sessions {
    /// A new session for `actor`; returns its id.
    pub fn open(&self, actor: &str) -> String {
        let bytes: [u8; 32] = rand::random();
        let id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        self.lock().insert(id.clone(), actor.to_owned());
        id
    }

    /// The actor of session `id`.
    pub fn actor(&self, id: &str) -> Option<String> {
        self.lock().get(id).cloned()
    }

    /// Ends session `id`.
    pub fn close(&self, id: &str) {
        self.lock().remove(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        // A panic elsewhere while holding it leaves a map that is still whole.
        self.by_id.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether `peer` is one of the trusted proxies.
pub(crate) fn from_trusted_proxy(config: &ConsoleConfig, peer: SocketAddr) -> bool {
    let ip = match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    config.trusted_proxies.contains(&ip)
}

/// Who sent a request with these headers from `peer`.
///
/// # Errors
///
/// [`ConsoleError::Unauthenticated`] when nothing proves who it is.
pub(crate) fn identify(
    config: &ConsoleConfig,
    sessions: &Sessions,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Result<Identity, ConsoleError> {
    if let Some(name) = &config.trusted_user_header {
        if from_trusted_proxy(config, peer) {
            if let Some(user) = headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|u| !u.is_empty())
            {
                return Ok(Identity {
                    actor: user.to_owned(),
                    credential: Credential::Proxy,
                });
            }
        }
    }
    if let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return config
            .tokens
            .actor(token.trim())
            .map(|actor| Identity {
                actor: actor.to_owned(),
                credential: Credential::Bearer,
            })
            .ok_or(ConsoleError::Unauthenticated);
    }
    if let Some(id) = cookie(headers, SESSION_COOKIE) {
        if let Some(actor) = sessions.actor(&id) {
            return Ok(Identity {
                actor,
                credential: Credential::Session(id),
            });
        }
    }
    Err(ConsoleError::Unauthenticated)
}

/// The value of cookie `name`, if the request carries it.
pub(crate) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lines_name_their_actor_and_bad_lines_are_refused() {
        let tokens = Tokens::parse("\n# c\nalice: one \nbob:two:three\n").unwrap();
        assert_eq!(tokens.actor("one"), Some("alice"));
        assert_eq!(tokens.actor("two:three"), Some("bob"));
        assert_eq!(tokens.actor("two"), None);
        assert!(matches!(
            Tokens::parse("alice:one\nnocolon\n"),
            Err(ConsoleError::TokenFile { line: 2 })
        ));
        assert!(Tokens::parse(":x").is_err());
        assert!(!format!("{tokens:?}").contains("one"));
    }

    #[test]
    fn the_proxy_header_counts_only_from_a_trusted_proxy() {
        let mut config = ConsoleConfig::new(Default::default());
        config.trusted_user_header = Some("x-forwarded-user".to_owned());
        config.trusted_proxies = vec!["10.0.0.1".parse().unwrap()];
        let sessions = Sessions::default();
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-user", "carol".parse().unwrap());
        let proxy: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let other: SocketAddr = "10.0.0.2:5000".parse().unwrap();
        assert_eq!(
            identify(&config, &sessions, &headers, proxy).unwrap().actor,
            "carol"
        );
        assert!(identify(&config, &sessions, &headers, other).is_err());
    }
}
