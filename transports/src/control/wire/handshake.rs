//! Handshake payloads: `Hello`, `HelloAck` (the session), `Auth` (join
//! proof, token proofs by segment id or name, each naming the grant it
//! asks for) and `AuthAck` (verdicts, with the descriptor of each segment
//! proven and a receipt for its grant now).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::{put_str8, FrameError, Reader, VERSION};
use crate::segment::Rights;

/// Largest handshake payload either side accepts.
pub const MAX_HANDSHAKE_PAYLOAD: usize = 256 * 1024;
/// Most endpoints per segment.
const MAX_ENDPOINTS: usize = 16;
/// Most proofs in one `Auth`.
const MAX_PROOFS: usize = 4096;

/// Initiator → target, the first frame on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Lowest protocol version the initiator speaks.
    pub version_min: u16,
    /// Highest protocol version the initiator speaks.
    pub version_max: u16,
    /// The session to join (from an earlier `HelloAck` to this initiator),
    /// or 0 for a new one.
    pub session: u64,
    /// The initiator's shard count.
    pub shards: u16,
    /// Fresh random bytes for the token challenge.
    pub nonce: [u8; 16],
    /// The initiator's node name.
    pub node: String,
}

/// Where and what a remote segment is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// The segment's id at its target.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// The target's virtual address of its first byte: how callers that
    /// address remote memory by the peer's addresses (Mooncake's API) map
    /// an address to an offset. Given only to peers that proved the token.
    pub base: u64,
    /// What a peer holding its token may do.
    pub rights: Rights,
    /// Addresses of the engine(s) serving it.
    pub endpoints: Vec<SocketAddr>,
    /// The segment's grant epoch when the target answered, with the
    /// target's tag: a later proof naming it is granted that epoch
    /// (PROTOCOL.md §5.1).
    pub grant: GrantReceipt,
}

/// A target's receipt for a segment's grant epoch: `tag` is its
/// HMAC-SHA256 of the segment id and `epoch` under a key only it holds, so
/// a peer names an epoch only after the target told it — after that
/// epoch's revoke. [`NONE`](Self::NONE) names the first grant, epoch 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrantReceipt {
    /// The segment's grant epoch.
    pub epoch: u64,
    /// The target's tag for it (zeros for epoch 0).
    pub tag: [u8; 16],
}

impl GrantReceipt {
    /// No receipt: the first grant (epoch 0), which needs none.
    pub const NONE: GrantReceipt = GrantReceipt {
        epoch: 0,
        tag: [0; 16],
    };

    fn put(&self, o: &mut Vec<u8>) {
        o.extend_from_slice(&self.epoch.to_le_bytes());
        o.extend_from_slice(&self.tag);
    }

    fn get(r: &mut Reader<'_>) -> Result<GrantReceipt, FrameError> {
        Ok(GrantReceipt {
            epoch: r.u64()?,
            tag: r.array()?,
        })
    }
}

impl Descriptor {
    /// Whether `other` describes the same segment: id, name, memory and
    /// rights. A restarted target's segment may have an old one's id and
    /// name, not its memory.
    pub fn same_segment(&self, other: &Descriptor) -> bool {
        (self.id, &self.name, self.base, self.len, self.rights)
            == (other.id, &other.name, other.base, other.len, other.rights)
    }
}

/// Target → initiator, the answer to `Hello`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAck {
    /// The version both will speak.
    pub version: u16,
    /// The target's shard count.
    pub shards: u16,
    /// Fresh random bytes for the token challenge.
    pub nonce: [u8; 16],
    /// The target's node name.
    pub node: String,
    /// The connection's session: the one the hello asked to join if it is
    /// live at the target, else a new one the target chose.
    pub session: u64,
    /// For a new session, its key (joining connections prove it); zeros
    /// when joining.
    pub session_key: [u8; 16],
}

/// How a proof names its segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SegmentRef {
    /// By id (re-proving a segment this initiator opened before).
    Id(u64),
    /// By name (opening it).
    Name(String),
    /// By the target's virtual address of a byte inside it (opening the
    /// segment that holds that address, as Mooncake-style callers address
    /// remote memory).
    Address(u64),
    /// The segment registered first among those live now that the proof's
    /// token opens (Mooncake's `get_first_buffer_address`: a peer's first
    /// registered buffer).
    First,
}

/// Initiator → target: proofs that it holds segment tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthRequest {
    /// For a connection joining a live session, its proof of the session's
    /// key; zeros otherwise.
    pub join: [u8; 32],
    /// `(segment, HMAC proof, the grant asked for)`: the receipt of the
    /// newest grant epoch the initiator was told of, or
    /// [`GrantReceipt::NONE`].
    pub proofs: Vec<(SegmentRef, [u8; 32], GrantReceipt)>,
}

/// Target → initiator: one verdict per proof, in request order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthAck {
    /// `Ok` with the segment's descriptor, or `Forbidden` (wrong proof and
    /// unknown segment alike) without one.
    pub results: Vec<(super::Status, Option<Descriptor>)>,
}

impl Hello {
    /// Encodes the payload.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut o = Vec::with_capacity(32 + self.node.len());
        o.extend_from_slice(&self.version_min.to_le_bytes());
        o.extend_from_slice(&self.version_max.to_le_bytes());
        o.extend_from_slice(&self.session.to_le_bytes());
        o.extend_from_slice(&self.shards.to_le_bytes());
        o.extend_from_slice(&self.nonce);
        put_str8(&mut o, &self.node)?;
        Ok(o)
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<Hello, FrameError> {
        let mut r = Reader::new(b);
        let h = Hello {
            version_min: r.u16()?,
            version_max: r.u16()?,
            session: r.u64()?,
            shards: r.u16()?,
            nonce: r.array()?,
            node: r.str8()?,
        };
        r.finish()?;
        if h.version_min > h.version_max {
            return Err(FrameError::Invalid("version range"));
        }
        Ok(h)
    }

    /// The version to speak with this initiator, if any.
    pub fn negotiate(&self) -> Option<u16> {
        (self.version_min..=self.version_max)
            .contains(&VERSION)
            .then_some(VERSION)
    }
}

fn put_addr(o: &mut Vec<u8>, a: &SocketAddr) {
    match a.ip() {
        IpAddr::V4(ip) => {
            o.push(4);
            o.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            o.push(6);
            o.extend_from_slice(&ip.octets());
        }
    }
    o.extend_from_slice(&a.port().to_le_bytes());
}

fn get_addr(r: &mut Reader<'_>) -> Result<SocketAddr, FrameError> {
    let ip = match r.u8()? {
        4 => IpAddr::V4(Ipv4Addr::from(r.array::<4>()?)),
        6 => IpAddr::V6(Ipv6Addr::from(r.array::<16>()?)),
        _ => return Err(FrameError::Invalid("address family")),
    };
    Ok(SocketAddr::new(ip, r.u16()?))
}

impl HelloAck {
    /// Encodes the payload.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut o = Vec::with_capacity(64);
        o.extend_from_slice(&self.version.to_le_bytes());
        o.extend_from_slice(&self.shards.to_le_bytes());
        o.extend_from_slice(&self.nonce);
        put_str8(&mut o, &self.node)?;
        o.extend_from_slice(&self.session.to_le_bytes());
        o.extend_from_slice(&self.session_key);
        Ok(o)
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<HelloAck, FrameError> {
        let mut r = Reader::new(b);
        let ack = HelloAck {
            version: r.u16()?,
            shards: r.u16()?,
            nonce: r.array()?,
            node: r.str8()?,
            session: r.u64()?,
            session_key: r.array()?,
        };
        r.finish()?;
        Ok(ack)
    }
}

impl SegmentRef {
    /// Its bytes as a proof covers them — as they are sent: `0x00` and the
    /// id (u64 LE), `0x01` and the name (1-byte length, UTF-8; a name too
    /// long to send yields no bytes past the tag), `0x02` and the address
    /// (u64 LE), or `0x03` alone.
    pub fn proof_bytes(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(16);
        if self.put(&mut o).is_err() {
            o.truncate(1);
        }
        o
    }

    fn put(&self, o: &mut Vec<u8>) -> Result<(), FrameError> {
        match self {
            SegmentRef::Id(id) => {
                o.push(0);
                o.extend_from_slice(&id.to_le_bytes());
            }
            SegmentRef::Name(n) => {
                o.push(1);
                put_str8(o, n)?;
            }
            SegmentRef::Address(a) => {
                o.push(2);
                o.extend_from_slice(&a.to_le_bytes());
            }
            SegmentRef::First => o.push(3),
        }
        Ok(())
    }

    fn get(r: &mut Reader<'_>) -> Result<SegmentRef, FrameError> {
        match r.u8()? {
            0 => Ok(SegmentRef::Id(r.u64()?)),
            1 => Ok(SegmentRef::Name(r.str8()?)),
            2 => Ok(SegmentRef::Address(r.u64()?)),
            3 => Ok(SegmentRef::First),
            _ => Err(FrameError::Invalid("segment reference")),
        }
    }
}

impl Descriptor {
    fn put(&self, o: &mut Vec<u8>) -> Result<(), FrameError> {
        o.extend_from_slice(&self.id.to_le_bytes());
        o.extend_from_slice(&self.len.to_le_bytes());
        o.extend_from_slice(&self.base.to_le_bytes());
        o.push(self.rights.bits());
        put_str8(o, &self.name)?;
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(FrameError::Invalid("too many endpoints"));
        }
        o.push(self.endpoints.len() as u8);
        for e in &self.endpoints {
            put_addr(o, e);
        }
        self.grant.put(o);
        Ok(())
    }

    fn get(r: &mut Reader<'_>) -> Result<Descriptor, FrameError> {
        let id = r.u64()?;
        let len = r.u64()?;
        let base = r.u64()?;
        let rights = Rights::from_bits(r.u8()?).ok_or(FrameError::Invalid("rights"))?;
        let name = r.str8()?;
        let ne = r.u8()? as usize;
        if ne > MAX_ENDPOINTS {
            return Err(FrameError::Invalid("too many endpoints"));
        }
        let endpoints = (0..ne).map(|_| get_addr(r)).collect::<Result<_, _>>()?;
        let grant = GrantReceipt::get(r)?;
        Ok(Descriptor {
            id,
            name,
            len,
            base,
            rights,
            endpoints,
            grant,
        })
    }
}

impl AuthRequest {
    /// Encodes the payload.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        if self.proofs.len() > MAX_PROOFS {
            return Err(FrameError::Invalid("too many proofs"));
        }
        let mut o = Vec::with_capacity(34 + self.proofs.len() * 65);
        o.extend_from_slice(&self.join);
        o.extend_from_slice(&(self.proofs.len() as u16).to_le_bytes());
        for (seg, proof, grant) in &self.proofs {
            seg.put(&mut o)?;
            o.extend_from_slice(proof);
            grant.put(&mut o);
        }
        if o.len() > MAX_HANDSHAKE_PAYLOAD {
            return Err(FrameError::Invalid("handshake payload too large"));
        }
        Ok(o)
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<AuthRequest, FrameError> {
        let mut r = Reader::new(b);
        let join = r.array()?;
        let n = r.u16()? as usize;
        if n > MAX_PROOFS {
            return Err(FrameError::Invalid("too many proofs"));
        }
        let proofs = (0..n)
            .map(|_| {
                let seg = SegmentRef::get(&mut r)?;
                let proof = r.array()?;
                Ok((seg, proof, GrantReceipt::get(&mut r)?))
            })
            .collect::<Result<_, FrameError>>()?;
        r.finish()?;
        Ok(AuthRequest { join, proofs })
    }
}

impl AuthAck {
    /// Encodes the payload.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        if self.results.len() > MAX_PROOFS {
            return Err(FrameError::Invalid("too many results"));
        }
        let mut o = Vec::with_capacity(2 + self.results.len() * 48);
        o.extend_from_slice(&(self.results.len() as u16).to_le_bytes());
        for (st, desc) in &self.results {
            o.push(*st as u8);
            match desc {
                Some(d) => {
                    o.push(1);
                    d.put(&mut o)?;
                }
                None => o.push(0),
            }
        }
        if o.len() > MAX_HANDSHAKE_PAYLOAD {
            return Err(FrameError::Invalid("handshake payload too large"));
        }
        Ok(o)
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<AuthAck, FrameError> {
        let mut r = Reader::new(b);
        let n = r.u16()? as usize;
        if n > MAX_PROOFS {
            return Err(FrameError::Invalid("too many results"));
        }
        let results = (0..n)
            .map(|_| {
                let st = super::Status::from_u8(r.u8()?).ok_or(FrameError::Invalid("status"))?;
                let desc = match r.u8()? {
                    0 => None,
                    1 => Some(Descriptor::get(&mut r)?),
                    _ => return Err(FrameError::Invalid("descriptor flag")),
                };
                Ok((st, desc))
            })
            .collect::<Result<_, FrameError>>()?;
        r.finish()?;
        Ok(AuthAck { results })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_messages_round_trip() {
        let h = Hello {
            version_min: 1,
            version_max: 3,
            session: 9,
            shards: 2,
            nonce: [7; 16],
            node: "a".into(),
        };
        assert_eq!(Hello::decode(&h.encode().unwrap()).unwrap(), h);
        let ack = HelloAck {
            version: 3,
            shards: 4,
            nonce: [1; 16],
            node: "target".into(),
            session: 77,
            session_key: [9; 16],
        };
        assert_eq!(HelloAck::decode(&ack.encode().unwrap()).unwrap(), ack);
        let a = AuthRequest {
            join: [4; 32],
            proofs: vec![
                (SegmentRef::Id(5), [3; 32], GrantReceipt::NONE),
                (
                    SegmentRef::Name("kv".into()),
                    [2; 32],
                    GrantReceipt {
                        epoch: 3,
                        tag: [8; 16],
                    },
                ),
                (
                    SegmentRef::Address(0x7f00_0000_1234),
                    [1; 32],
                    GrantReceipt::NONE,
                ),
            ],
        };
        assert_eq!(AuthRequest::decode(&a.encode().unwrap()).unwrap(), a);
        let aa = AuthAck {
            results: vec![
                (crate::control::wire::Status::Forbidden, None),
                (
                    crate::control::wire::Status::Ok,
                    Some(Descriptor {
                        id: 5,
                        name: "kv".into(),
                        len: 1 << 30,
                        base: 0x7f00_0000_1000,
                        rights: Rights::READ | Rights::WRITE,
                        endpoints: vec![
                            "127.0.0.1:9".parse().unwrap(),
                            "[::1]:10".parse().unwrap(),
                        ],
                        grant: GrantReceipt {
                            epoch: 2,
                            tag: [6; 16],
                        },
                    }),
                ),
            ],
        };
        assert_eq!(AuthAck::decode(&aa.encode().unwrap()).unwrap(), aa);
    }

    #[test]
    fn truncated_and_trailing_payloads_are_errors() {
        let h = Hello {
            version_min: 1,
            version_max: 1,
            session: 1,
            shards: 1,
            nonce: [0; 16],
            node: "n".into(),
        };
        let b = h.encode().unwrap();
        for cut in 0..b.len() {
            assert!(Hello::decode(&b[..cut]).is_err());
        }
        let mut long = b.clone();
        long.push(0);
        assert!(Hello::decode(&long).is_err());
        assert!(HelloAck::decode(&[0xff; 40]).is_err());
    }
}
