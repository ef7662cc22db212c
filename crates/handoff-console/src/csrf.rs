//! Anti-forgery tokens for the console's forms: an HMAC of who is signed in (the session, or
//! the proxied user) under a key made at start-up. A page from another site cannot read it, so
//! its forms cannot carry it; SameSite=Strict cookies are the second lock on the same door.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::auth::{constant_time_eq, Identity};

/// The key tokens are made with; a restart makes every open form's token stale.
pub(crate) struct CsrfKey([u8; 32]);

impl CsrfKey {
    /// A fresh random key.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// The token `identity`'s forms carry.
    pub fn token(&self, identity: &Identity) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(identity.csrf_subject().as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    }

    /// Whether `token` is `identity`'s.
    pub fn verify(&self, identity: &Identity, token: Option<&str>) -> bool {
        token.is_some_and(|t| constant_time_eq(t.as_bytes(), self.token(identity).as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Credential;

    #[test]
    fn a_token_is_bound_to_its_session() {
        let key = CsrfKey::random();
        let one = Identity {
            actor: "a".into(),
            credential: Credential::Session("s1".into()),
        };
        let two = Identity {
            actor: "a".into(),
            credential: Credential::Session("s2".into()),
        };
        assert!(key.verify(&one, Some(&key.token(&one))));
        assert!(!key.verify(&two, Some(&key.token(&one))));
        assert!(!key.verify(&one, None));
    }
}
