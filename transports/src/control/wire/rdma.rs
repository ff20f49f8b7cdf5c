//! RDMA connection payloads, exchanged on the control connection after the
//! tokens are proven: `QpConnect` (initiator → target) and `QpAccept`.

use super::{FrameError, Reader};

/// Most keys one `QpAccept` carries.
const MAX_KEYS: usize = 4096;
/// Bytes of a [`QpWire`] on the wire.
const QP_WIRE_BYTES: usize = 4 + 4 + 16 + 2 + 1;
/// Largest `QpAccept` payload an initiator accepts: one of 4,096 keys
/// (status, queue pair, count, 20 bytes per key), the most a target sends.
pub const MAX_QP_PAYLOAD: usize = 1 + QP_WIRE_BYTES + 2 + 20 * MAX_KEYS;
/// A `QpConnect` payload's size: a queue pair, nothing else.
pub const QP_CONNECT_PAYLOAD: usize = QP_WIRE_BYTES;

/// How to reach a queue pair (see `quiesce_transports::rdma::QpEndpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpWire {
    /// Queue pair number (0: no queue pair).
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Port GID.
    pub gid: [u8; 16],
    /// Port LID (InfiniBand only).
    pub lid: u16,
    /// Active path MTU (`ibv_mtu`: 1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// Initiator → target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpConnect {
    /// The initiator's new queue pair; `qpn == 0` asks for keys only.
    pub qp: QpWire,
}

/// Where a segment lives in the target's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteKey {
    /// The segment id.
    pub segment: u64,
    /// Virtual address of its first byte.
    pub addr: u64,
    /// Its memory region's remote key.
    pub rkey: u32,
}

/// Target → initiator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpAccept {
    /// 0: accepted; 1: the target has no RDMA device; 2: it could not
    /// create or connect a queue pair.
    pub status: u8,
    /// The target's queue pair, connected to the initiator's (`qpn == 0`
    /// when only keys were asked for).
    pub qp: QpWire,
    /// Keys of the segments whose tokens were proven on this connection.
    pub keys: Vec<RemoteKey>,
}

fn put_qp(o: &mut Vec<u8>, q: &QpWire) {
    o.extend_from_slice(&q.qpn.to_le_bytes());
    o.extend_from_slice(&q.psn.to_le_bytes());
    o.extend_from_slice(&q.gid);
    o.extend_from_slice(&q.lid.to_le_bytes());
    o.push(q.mtu);
}

fn get_qp(r: &mut Reader<'_>) -> Result<QpWire, FrameError> {
    let q = QpWire {
        qpn: r.u32()?,
        psn: r.u32()?,
        gid: r.array()?,
        lid: r.u16()?,
        mtu: r.u8()?,
    };
    if q.qpn > 0xff_ffff || q.psn > 0xff_ffff {
        return Err(FrameError::Invalid("qpn/psn wider than 24 bits"));
    }
    if q.qpn != 0 && !(1..=5).contains(&q.mtu) {
        return Err(FrameError::Invalid("mtu"));
    }
    Ok(q)
}

impl QpConnect {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(27);
        put_qp(&mut o, &self.qp);
        o
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<QpConnect, FrameError> {
        let mut r = Reader::new(b);
        let qp = get_qp(&mut r)?;
        r.finish()?;
        Ok(QpConnect { qp })
    }
}

impl QpAccept {
    /// Encodes the payload.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        if self.keys.len() > MAX_KEYS {
            return Err(FrameError::Invalid("too many keys"));
        }
        let mut o = Vec::with_capacity(32 + self.keys.len() * 20);
        o.push(self.status);
        put_qp(&mut o, &self.qp);
        o.extend_from_slice(&(self.keys.len() as u16).to_le_bytes());
        for k in &self.keys {
            o.extend_from_slice(&k.segment.to_le_bytes());
            o.extend_from_slice(&k.addr.to_le_bytes());
            o.extend_from_slice(&k.rkey.to_le_bytes());
        }
        Ok(o)
    }

    /// Decodes the payload.
    pub fn decode(b: &[u8]) -> Result<QpAccept, FrameError> {
        let mut r = Reader::new(b);
        let status = r.u8()?;
        let qp = get_qp(&mut r)?;
        let n = r.u16()? as usize;
        if n > MAX_KEYS {
            return Err(FrameError::Invalid("too many keys"));
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(RemoteKey {
                segment: r.u64()?,
                addr: r.u64()?,
                rkey: r.u32()?,
            });
        }
        r.finish()?;
        Ok(QpAccept { status, qp, keys })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_payloads_round_trip_and_reject_garbage() {
        let qp = QpWire {
            qpn: 17,
            psn: 0x12_3456,
            gid: [9; 16],
            lid: 0,
            mtu: 3,
        };
        let c = QpConnect { qp };
        assert_eq!(QpConnect::decode(&c.encode()).unwrap(), c);
        let a = QpAccept {
            status: 0,
            qp,
            keys: vec![RemoteKey {
                segment: 3,
                addr: 0x7f00_0000_1000,
                rkey: 0xabcd,
            }],
        };
        assert_eq!(QpAccept::decode(&a.encode().unwrap()).unwrap(), a);
        let mut bad = c.encode();
        bad[3] = 0x01; // qpn wider than 24 bits
        assert!(QpConnect::decode(&bad).is_err());
        let mut bad = c.encode();
        bad[26] = 9; // mtu
        assert!(QpConnect::decode(&bad).is_err());
        assert!(QpAccept::decode(&a.encode().unwrap()[..30]).is_err());
        let mut long = c.encode();
        long.push(0);
        assert!(QpConnect::decode(&long).is_err());
    }

    /// Every `QpAccept` a target may send fits what an initiator accepts:
    /// one for 4,096 segments (the most it carries) took 81,950 bytes, past
    /// the 64 KiB an initiator read, so a connection that had proved 3,277
    /// segments or more could never get its keys.
    #[test]
    fn the_largest_qp_accept_fits_the_payload_limit() {
        let a = QpAccept {
            status: 0,
            qp: QpWire::default(),
            keys: vec![
                RemoteKey {
                    segment: 1,
                    addr: 2,
                    rkey: 3,
                };
                MAX_KEYS
            ],
        };
        let p = a.encode().unwrap();
        assert!(p.len() <= MAX_QP_PAYLOAD, "{} bytes", p.len());
        assert_eq!(QpAccept::decode(&p).unwrap(), a);
    }
}
