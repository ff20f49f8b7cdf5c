//! Reading a prefix of the directory in pages. One unpaged read of the
//! whole directory is one gRPC reply, which the client refuses past 4 MiB
//! (tonic's default): tens of thousands of segments, or three large values
//! anyone with write access put under the prefix, and no node could join
//! or reconnect. Pages of [`PAGE`] entries at one revision, each decoded up
//! to [`REPLY_LIMIT`], stay under it even when every entry is as large as
//! etcd lets a value be (1.5 MiB by default).

use etcd_client::{Client, GetOptions, KeyValue};

/// Entries one read asks for.
const PAGE: i64 = 128;

/// The largest reply the directory's reads decode.
pub(super) const REPLY_LIMIT: usize = 256 << 20;

/// Every entry under `prefix` at one revision, in key order, and that
/// revision.
pub(super) async fn read_prefix(
    client: &Client,
    prefix: &str,
) -> Result<(Vec<KeyValue>, i64), etcd_client::Error> {
    let mut kv = client.kv_client().max_decoding_message_size(REPLY_LIMIT);
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = None;
    let mut all = Vec::new();
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if let Some(r) = revision {
            // The same snapshot as the first page's.
            opts = opts.with_revision(r);
        }
        let mut page = kv.get(from.clone(), Some(opts)).await?;
        let at = *revision.get_or_insert_with(|| page.header().map_or(0, |h| h.revision()));
        let more = page.more();
        let kvs = page.take_kvs();
        let Some(last) = kvs.last() else {
            return Ok((all, at));
        };
        // The next page starts just past the last key of this one.
        from = last.key().to_vec();
        from.push(0);
        all.extend(kvs);
        if !more {
            return Ok((all, at));
        }
    }
}

/// The first key past every key that starts with `prefix` (etcd's range
/// end for a prefix read): its last byte below 0xff, plus one.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            *end.last_mut().expect("not empty") += 1;
            return end;
        }
        end.pop();
    }
    // Every byte 0xff (or none): to the end of the key space.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_past_its_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"big/"), b"big0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
