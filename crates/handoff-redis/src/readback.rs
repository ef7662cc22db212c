//! Reading the stream back ([`ReadBack`]) for `handoff replay`, `handoff reconcile`, test
//! support, chaos and the demo.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use handoff_core::readback::{
    MessageScan, ReadBack, ReadBackError, ReadBackErrorKind, ReadFrom, StoredMessage,
};
use redis::Value;

use crate::entry::{self, Entry};
use crate::link::Link;
use crate::RedisTransport;

/// Entries asked for per `XRANGE` page.
const PAGE: usize = 512;

/// A read of the stream in entry-id order, from where it was started up to the last entry the
/// stream held then; see [`RedisTransport`]'s [`ReadBack`] implementation.
///
/// Positions are entry ids (`"1733390000000-0"`); each message carries every field but the
/// payload as a header, and the payload.
pub struct RedisScan {
    link: Arc<Link>,
    stream: String,
    timeout: Duration,
    /// The next page starts here: inclusive at first, then `(` and the last id read.
    start: String,
    /// The stream's last entry id when the scan began; `None` for an empty stream.
    end: Option<String>,
    page: VecDeque<Entry>,
}

impl std::fmt::Debug for RedisScan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisScan")
            .field("stream", &self.stream)
            .field("start", &self.start)
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

impl RedisScan {
    /// The last entry id this scan reads up to (the stream's last when it began), or `None`
    /// when the stream was empty.
    pub fn end(&self) -> Option<&str> {
        self.end.as_deref()
    }

    async fn range(
        &self,
        command: &str,
        start: &str,
        end: &str,
    ) -> Result<Vec<Entry>, ReadBackError> {
        let stream = self.stream.as_str();
        let reply: Value = self
            .link
            .call(self.timeout, |mut connection| async move {
                redis::cmd(command)
                    .arg(stream)
                    .arg(start)
                    .arg(end)
                    .arg("COUNT")
                    .arg(PAGE)
                    .query_async(&mut connection)
                    .await
            })
            .await
            .map_err(|e| e.into_read_back_error(&format!("while reading stream {stream}")))?;
        entry::entries(reply).map_err(|e| {
            ReadBackError::with_source(
                ReadBackErrorKind::Other,
                format!("while reading stream {stream}"),
                e,
            )
        })
    }
}

impl MessageScan for RedisScan {
    async fn next(&mut self) -> Result<Option<StoredMessage>, ReadBackError> {
        if self.page.is_empty() {
            let Some(end) = self.end.clone() else {
                return Ok(None);
            };
            let start = self.start.clone();
            let page = self.range("XRANGE", &start, &end).await?;
            match page.last() {
                Some(last) if last.id != end => self.start = format!("({}", last.id),
                // The last entry of the scan is in this page, or nothing is left (trimmed).
                _ => self.end = None,
            }
            self.page = page.into();
        }
        let Some(entry) = self.page.pop_front() else {
            return Ok(None);
        };
        let mut message = StoredMessage::default();
        message.event_id = entry.event_id();
        message.replay = entry.replay();
        message.headers = entry.headers();
        message.payload = entry.payload().map(<[u8]>::to_vec);
        message.subject = self.stream.clone();
        message.position = entry.id;
        Ok(Some(message))
    }
}

/// The first entry id at or after `from`: `-` for the start, `<ms>-0` for a time.
fn start_id(from: &ReadFrom) -> Result<String, ReadBackError> {
    match from {
        ReadFrom::Time(at) => Ok(entry_id_at(*at)),
        ReadFrom::Position(id) => match entry::parse_id(id) {
            Some((ms, seq)) => Ok(format!("{ms}-{seq}")),
            None => Err(ReadBackError::new(
                ReadBackErrorKind::Invalid,
                format!("{id:?} is not a redis stream entry id (<ms>-<seq>)"),
            )),
        },
        _ => Ok("-".to_owned()),
    }
}

impl ReadBack for RedisTransport {
    type Scan = RedisScan;

    /// Reads [`RedisConfig::stream`](crate::RedisConfig::stream) with `XRANGE`, 512 entries a
    /// page, from `from` (an entry id for [`ReadFrom::Position`]; for [`ReadFrom::Time`], the
    /// entry id Redis gave the first append at or after that time, as ids are the server's
    /// clock in milliseconds) up to the stream's last entry when the read began.
    ///
    /// # Errors
    ///
    /// [`ReadBackErrorKind::NotFound`] when the key does not exist,
    /// [`ReadBackErrorKind::Invalid`] for a position that is not an entry id,
    /// [`ReadBackErrorKind::Unavailable`] when the server does not answer.
    ///
    /// # Cancel safety
    ///
    /// Nothing is left on the server.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_core::readback::{MessageScan, ReadBack, ReadFrom};
    ///
    /// # async fn example(transport: &handoff_redis::RedisTransport) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut scan = transport.read_back(ReadFrom::Start).await?;
    /// while let Some(message) = scan.next().await? {
    ///     println!("{} {:?}", message.position, message.event_id);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    async fn read_back(&self, from: ReadFrom) -> Result<RedisScan, ReadBackError> {
        let start = start_id(&from)?;
        let stream = self.config().stream.clone();
        let timeout = self.config().publish_timeout;
        let kind: String = self
            .link
            .call(timeout, |mut connection| {
                let stream = stream.clone();
                async move {
                    redis::cmd("TYPE")
                        .arg(stream)
                        .query_async(&mut connection)
                        .await
                }
            })
            .await
            .map_err(|e| e.into_read_back_error(&format!("while looking up stream {stream}")))?;
        match kind.as_str() {
            "stream" => {}
            "none" => {
                return Err(ReadBackError::new(
                    ReadBackErrorKind::NotFound,
                    format!("stream {stream} does not exist"),
                ))
            }
            other => {
                return Err(ReadBackError::new(
                    ReadBackErrorKind::Other,
                    format!("key {stream} holds a {other}, not a stream"),
                ))
            }
        }
        let mut scan = RedisScan {
            link: self.link.clone(),
            stream,
            timeout,
            start,
            end: None,
            page: VecDeque::new(),
        };
        let last = scan.range("XREVRANGE", "+", "-").await?;
        scan.end = last.into_iter().next().map(|entry| entry.id);
        Ok(scan)
    }
}

/// The entry id Redis gives an append at `at` (its clock, in milliseconds): `<ms>-0`. For
/// positions a caller computes, such as "everything since an hour ago".
///
/// # Examples
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
///
/// let at = UNIX_EPOCH + Duration::from_millis(1_733_390_000_123);
/// assert_eq!(handoff_redis::entry_id_at(at), "1733390000123-0");
/// ```
pub fn entry_id_at(at: SystemTime) -> String {
    let ms = at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    format!("{ms}-0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_map_onto_entry_ids() {
        assert_eq!(start_id(&ReadFrom::Start).unwrap(), "-");
        let at = UNIX_EPOCH + Duration::from_millis(42);
        assert_eq!(start_id(&ReadFrom::Time(at)).unwrap(), "42-0");
        assert_eq!(
            start_id(&ReadFrom::Position("17-3".into())).unwrap(),
            "17-3"
        );
        assert_eq!(
            start_id(&ReadFrom::Position("x".into()))
                .unwrap_err()
                .kind(),
            ReadBackErrorKind::Invalid
        );
    }
}
