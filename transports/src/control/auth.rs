//! Segment tokens and the challenge–response that proves holding one.
//!
//! A token never crosses the wire. Each side of a connection sends a fresh
//! 16-byte nonce in its hello; to open a segment (by name) or prove it again
//! (by id) the initiator sends `HMAC-SHA256(token, "quiesce-auth-v2" ‖ target
//! nonce ‖ initiator nonce ‖ session ‖ segment reference)`, which the target
//! recomputes and compares in constant time. Joining a session takes a
//! proof of its key ([`SessionKey`]).

use std::fmt;
use std::str::FromStr;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::control::wire::{GrantReceipt, SegmentRef};

type HmacSha256 = Hmac<Sha256>;

const DOMAIN: &[u8] = b"quiesce-auth-v2";
const JOIN_DOMAIN: &[u8] = b"quiesce-join-v1";
const GRANT_DOMAIN: &[u8] = b"quiesce-grant-v1";

/// Fills `out` from the kernel's CSPRNG (`getrandom(2)`: no file
/// descriptor, so a process at its `RLIMIT_NOFILE` still gets its bytes).
pub(crate) fn random_bytes(out: &mut [u8]) {
    // Fails only on a kernel without getrandom(2) (before 3.17) whose
    // /dev/urandom cannot be opened either: nothing to make keys from.
    getrandom::fill(out).expect("the kernel's CSPRNG (getrandom(2))");
}

/// A random 64-bit id.
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    random_bytes(&mut b);
    u64::from_le_bytes(b)
}

/// HMAC-SHA256 keyed with `key`, fed `parts` in order.
fn keyed(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        mac.update(p);
    }
    mac
}

/// A segment's secret: 128 random bits. Shown as 32 hex digits by `Display`
/// (to hand to authorised peers); `Debug` does not reveal it. Compared in
/// constant time.
#[derive(Clone, Copy)]
pub struct Token(pub(crate) [u8; 16]);

impl PartialEq for Token {
    fn eq(&self, other: &Token) -> bool {
        self.0.ct_eq(&other.0).into()
    }
}

impl Eq for Token {}

impl Token {
    /// A fresh random token.
    pub fn random() -> Token {
        let mut t = [0u8; 16];
        random_bytes(&mut t);
        Token(t)
    }

    /// The token a cluster that shares `secret` uses for `label` (a segment
    /// name, or a label all of a node's segments share): the first 128 bits
    /// of HMAC-SHA256(secret, "quiesce-token-v1" ‖ label). Every holder of
    /// the secret derives the same token; nobody without it can. Use a
    /// secret of at least 16 random bytes.
    pub fn derive(secret: &[u8], label: &str) -> Token {
        let mac = keyed(secret, &[b"quiesce-token-v1", label.as_bytes()]);
        let mut t = [0u8; 16];
        t.copy_from_slice(&mac.finalize().into_bytes()[..16]);
        Token(t)
    }

    /// The proof for segment `seg` on a connection with these nonces, in
    /// `session` (see `docs/PROTOCOL.md` §4.3), for initiators written
    /// against the protocol.
    pub fn prove(
        &self,
        target_nonce: &[u8; 16],
        initiator_nonce: &[u8; 16],
        session: u64,
        seg: &SegmentRef,
    ) -> [u8; 32] {
        self.mac(target_nonce, initiator_nonce, session, seg)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a proof in constant time.
    pub(crate) fn verify(
        &self,
        proof: &[u8; 32],
        target_nonce: &[u8; 16],
        initiator_nonce: &[u8; 16],
        session: u64,
        seg: &SegmentRef,
    ) -> bool {
        self.mac(target_nonce, initiator_nonce, session, seg)
            .verify_slice(proof)
            .is_ok()
    }

    fn mac(
        &self,
        target_nonce: &[u8; 16],
        initiator_nonce: &[u8; 16],
        session: u64,
        seg: &SegmentRef,
    ) -> HmacSha256 {
        keyed(
            &self.0,
            &[
                DOMAIN,
                target_nonce,
                initiator_nonce,
                &session.to_le_bytes(),
                &seg.proof_bytes(),
            ],
        )
    }
}

/// A session's key: the target chooses it with the session and hands it to
/// the connection that created it; a connection joins the session only by
/// proving it (`HMAC-SHA256(key, "quiesce-join-v1" ‖ target nonce ‖
/// initiator nonce ‖ session)`), so no other peer can act in it.
#[derive(Clone, Copy)]
pub(crate) struct SessionKey(pub(crate) [u8; 16]);

impl SessionKey {
    /// A fresh random key.
    pub(crate) fn random() -> SessionKey {
        let mut k = [0u8; 16];
        random_bytes(&mut k);
        SessionKey(k)
    }

    /// The join proof for a connection with these nonces.
    pub(crate) fn prove(
        &self,
        target_nonce: &[u8; 16],
        initiator_nonce: &[u8; 16],
        session: u64,
    ) -> [u8; 32] {
        self.mac(target_nonce, initiator_nonce, session)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a join proof in constant time.
    pub(crate) fn verify(
        &self,
        proof: &[u8; 32],
        target_nonce: &[u8; 16],
        initiator_nonce: &[u8; 16],
        session: u64,
    ) -> bool {
        self.mac(target_nonce, initiator_nonce, session)
            .verify_slice(proof)
            .is_ok()
    }

    fn mac(&self, target_nonce: &[u8; 16], initiator_nonce: &[u8; 16], session: u64) -> HmacSha256 {
        keyed(
            &self.0,
            &[
                JOIN_DOMAIN,
                target_nonce,
                initiator_nonce,
                &session.to_le_bytes(),
            ],
        )
    }
}

/// The target's key for grant receipts ([`GrantReceipt`]): random per
/// engine, never sent. A receipt's tag is the first 128 bits of
/// HMAC-SHA256(key, "quiesce-grant-v1" ‖ segment id ‖ epoch).
pub(crate) struct GrantKey([u8; 32]);

impl GrantKey {
    /// A fresh random key.
    pub(crate) fn random() -> GrantKey {
        let mut k = [0u8; 32];
        random_bytes(&mut k);
        GrantKey(k)
    }

    /// The receipt for `segment`'s grant `epoch` (epoch 0 needs none).
    pub(crate) fn receipt(&self, segment: u64, epoch: u64) -> GrantReceipt {
        if epoch == 0 {
            return GrantReceipt::NONE;
        }
        let mac = keyed(
            &self.0,
            &[GRANT_DOMAIN, &segment.to_le_bytes(), &epoch.to_le_bytes()],
        );
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&mac.finalize().into_bytes()[..16]);
        GrantReceipt { epoch, tag }
    }

    /// Whether `r` is this key's receipt for `segment` (in constant time).
    pub(crate) fn issued(&self, segment: u64, r: &GrantReceipt) -> bool {
        self.receipt(segment, r.epoch).tag.ct_eq(&r.tag).into()
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(<redacted>)")
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// The text is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a token is 32 hex digits")]
pub struct BadToken;

impl FromStr for Token {
    type Err = BadToken;
    fn from_str(s: &str) -> Result<Token, BadToken> {
        let s = s.trim();
        if s.len() != 32 || !s.is_ascii() {
            return Err(BadToken);
        }
        let mut t = [0u8; 16];
        for (i, b) in t.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| BadToken)?;
        }
        Ok(Token(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nonces, session keys and random tokens need no file descriptor: a
    /// target at its `RLIMIT_NOFILE` (a flood of connections) still says
    /// hello to the one it accepted last, and an initiator out of
    /// descriptors gets an error, not a panic. The check runs in a child
    /// process, whose limit is 0.
    #[test]
    fn random_bytes_need_no_file_descriptor() {
        const CHILD: &str = "QUIESCE_TEST_NO_FDS";
        if std::env::var_os(CHILD).is_some() {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: `lim` is a valid rlimit to fill, then to set; this
            // process is the child's.
            unsafe {
                assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
                lim.rlim_cur = 0;
                assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
            }
            assert!(std::fs::File::open("/dev/null").is_err(), "the limit holds");
            let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
            random_bytes(&mut a);
            random_bytes(&mut b);
            println!("RANDOM OK {}", a != b);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "control::auth::tests::random_bytes_need_no_file_descriptor",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("RANDOM OK true"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn proofs_verify_only_with_the_right_token_and_nonces() {
        let t = Token::random();
        let (tn, inn) = ([1u8; 16], [2u8; 16]);
        let (id, other) = (SegmentRef::Id(42), SegmentRef::Id(43));
        let p = t.prove(&tn, &inn, 7, &id);
        assert!(t.verify(&p, &tn, &inn, 7, &id));
        assert!(!t.verify(&p, &tn, &inn, 7, &other));
        assert!(!t.verify(&p, &tn, &inn, 8, &id));
        assert!(!t.verify(&p, &inn, &tn, 7, &id));
        assert!(!t.verify(&p, &tn, &inn, 7, &SegmentRef::Name("42".into())));
        assert!(!Token::random().verify(&p, &tn, &inn, 7, &id));
        let k = SessionKey::random();
        let j = k.prove(&tn, &inn, 7);
        assert!(k.verify(&j, &tn, &inn, 7));
        assert!(!k.verify(&j, &tn, &inn, 8));
        assert!(!SessionKey::random().verify(&j, &tn, &inn, 7));
    }

    #[test]
    fn tokens_compare_by_every_byte() {
        let t = Token::random();
        assert_eq!(t, t.to_string().parse().unwrap());
        for i in 0..16 {
            let mut u = t;
            u.0[i] ^= 1;
            assert_ne!(t, u, "byte {i}");
        }
    }

    #[test]
    fn tokens_round_trip_as_hex_and_hide_in_debug() {
        let t = Token::random();
        assert_eq!(t.to_string().parse::<Token>().unwrap(), t);
        assert!(!format!("{t:?}").contains(&t.to_string()));
        assert_eq!("xyz".parse::<Token>(), Err(BadToken));
    }
}
