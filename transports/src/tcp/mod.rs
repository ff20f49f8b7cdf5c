//! The TCP data path: the initiator's connections and peers (transfers cut
//! into slices and striped over connections), and the target's handling of
//! `Write` and `Read` frames on the connections the control server accepted.

pub(crate) mod conn;
mod grant;
mod open;
pub(crate) mod own_ids;
pub(crate) mod peer;
pub(crate) mod request;
pub(crate) mod responses;
pub(crate) mod segment;
mod send;
pub(crate) mod serve;
pub(crate) mod split;
