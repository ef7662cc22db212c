//! Secrets kept out of `Debug` output and logs: the hand-written `Debug` impls of the
//! destination crates' configurations show URLs through [`url`].

/// What stands in for a hidden value.
pub const REDACTED: &str = "***";

/// `text`, a URL such as `scheme://user:password@host:port/path?query#fragment`, with every
/// part that may hold a secret replaced by `***`:
///
/// - the password of the user information (`user:***@`), or the whole user information when
///   it has no password (a lone `token@`, the NATS and git convention, is a credential);
/// - the value of every query parameter (`?token=***&a=***`), and a parameter without `=`;
/// - the fragment.
///
/// Scheme, host, port and path are kept, so the output still says where a client connects.
/// A comma-separated list of URLs (`nats://a:4222,nats://u:pw@b:4222`) is redacted URL by URL.
/// It works on the text alone and never fails: anything that is not a URL is treated as one
/// whose authority runs to the first `/`, `?` or `#`.
///
/// # Examples
///
/// ```
/// use handoff_core::redact;
///
/// assert_eq!(
///     redact::url("https://bot:s3cret@hooks.example.com/in?token=abc&v=2"),
///     "https://bot:***@hooks.example.com/in?token=***&v=***"
/// );
/// assert_eq!(redact::url("nats://t0k3n@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact::url("postgres://127.0.0.1/app"), "postgres://127.0.0.1/app");
/// ```
pub fn url(text: &str) -> String {
    let mut shown = String::with_capacity(text.len() + 16);
    let mut start = 0;
    for (at, _) in text.match_indices(',') {
        // A comma followed by `scheme://` starts the next URL of a list; any other comma is
        // part of the current URL (a query value, say).
        if starts_with_scheme(&text[at + 1..]) {
            shown.push_str(&one(&text[start..at]));
            shown.push(',');
            start = at + 1;
        }
    }
    shown.push_str(&one(&text[start..]));
    shown
}

/// Whether `text` opens with `scheme://` (RFC 3986: a letter, then letters, digits, `+-.`).
fn starts_with_scheme(text: &str) -> bool {
    let text = text.trim_start();
    let Some((scheme, _)) = text.split_once("://") else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

/// One URL of [`url`]'s input.
fn one(text: &str) -> String {
    let (text, fragment) = match text.split_once('#') {
        Some((rest, _)) => (rest, true),
        None => (text, false),
    };
    let (text, query) = match text.split_once('?') {
        Some((rest, query)) => (rest, Some(query)),
        None => (text, None),
    };
    let (scheme, rest) = match text.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, text),
    };
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let mut shown = String::with_capacity(text.len() + 16);
    if let Some(scheme) = scheme {
        shown.push_str(scheme);
        shown.push_str("://");
    }
    // The last `@` ends the user information: a password may hold an unencoded `@`.
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            match userinfo.split_once(':') {
                Some((user, _password)) => {
                    shown.push_str(user);
                    shown.push(':');
                    shown.push_str(REDACTED);
                }
                None => shown.push_str(REDACTED),
            }
            shown.push('@');
            shown.push_str(host);
        }
        None => shown.push_str(authority),
    }
    shown.push_str(path);
    if let Some(query) = query {
        shown.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _value)) => format!("{name}={REDACTED}"),
                None if pair.is_empty() => String::new(),
                None => REDACTED.to_owned(),
            })
            .collect();
        shown.push_str(&pairs.join("&"));
    }
    if fragment {
        shown.push('#');
        shown.push_str(REDACTED);
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_urls_are_hidden_and_the_address_kept() {
        for (given, shown) in [
            ("amqp://u:pw@h:5672/%2f", "amqp://u:***@h:5672/%2f"),
            ("nats://tok@h", "nats://***@h"),
            ("https://h/p?token=abc", "https://h/p?token=***"),
            ("https://h/p?abc&x=1#frag", "https://h/p?***&x=***#***"),
            ("http://u:p@ss@h/x", "http://u:***@h/x"),
            ("postgres://h/db", "postgres://h/db"),
            ("postgres://app:pw@h", "postgres://app:***@h"),
            ("h:9092", "h:9092"),
            ("user:pw@h:9092", "user:***@h:9092"),
            ("", ""),
            (
                "nats://a:4222, nats://u:pw@b:4222",
                "nats://a:4222, nats://u:***@b:4222",
            ),
            ("https://h/?a=1,2&b=3", "https://h/?a=***&b=***"),
        ] {
            assert_eq!(url(given), shown, "{given:?}");
        }
    }

    #[test]
    fn no_secret_survives() {
        for given in [
            "https://bot:s3cret@h/in?key=s3cret",
            "nats://s3cret@h,nats://h2",
            "nats://h1,nats://u:s3cret@h2",
            "amqp://u:s3cret@h?x#s3cret",
            "s3cret@h",
            "http://h/?s3cret",
        ] {
            assert!(!url(given).contains("s3cret"), "{given:?}: {}", url(given));
        }
    }
}
