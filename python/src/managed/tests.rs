use super::*;

/// A registration lying in a buffer keeps it from being freed; a buffer
/// being freed takes no new registration; its own is the one exception.
#[test]
fn registrations_and_frees_of_managed_buffers_exclude_each_other() {
    let m = ManagedBuffers::default();
    let a = m.allocate(1 << 20).unwrap();
    m.lending(a, 1 << 20).unwrap();
    assert_eq!(m.lending(a, 4096), Err(NotLendable::AlreadyLent));
    m.lending(a + 4096, 4096).unwrap();
    assert_eq!(
        m.lending(usize::MAX - 4095, 8192),
        Err(NotLendable::PastTheAddressSpace)
    );
    assert_eq!(m.begin_free(a, 1 << 20), Err(Held::LentAt(a + 4096)));
    m.lent_back(a + 4096);
    m.begin_free(a, 1 << 20).unwrap();
    assert_eq!(m.lending(a + 8192, 16), Err(NotLendable::BeingFreed(a)));
    // Nor does a batch start from it (the free would answer -2 with
    // its registration taken back).
    assert!(matches!(m.take_uses([(a + 100, 16)].into_iter()), Err(at) if at == a));
    assert_eq!(m.begin_free(a, 1 << 20), Err(Held::Freeing));
    assert_eq!(
        m.free(a, 1 << 20),
        Free::InUse,
        "its own registration is live"
    );
    m.lent_back(a);
    assert_eq!(m.free(a, 1 << 20), Free::Done);
    // A range next to a buffer is not in it.
    let b = m.allocate(4096).unwrap();
    m.lending(b + 4096, 4096).unwrap();
    m.begin_free(b, 4096).unwrap();
    assert_eq!(m.free(b, 4096), Free::Done);
}

/// A batch counts every registration its local ranges overlap; one
/// being unregistered takes no new batch, and is unused once the
/// batches that counted it gave their uses back — not counted down by
/// uses of an earlier registration at its address.
#[test]
fn batches_count_the_registrations_they_overlap() {
    let m = ManagedBuffers::default();
    let (a, b) = (0x10_0000, 0x30_0000);
    m.lending(a, 1 << 20).unwrap();
    m.lending(a + 4096, 4096).unwrap();
    m.lending(b, 4096).unwrap();
    let one = m.take_uses([(a + 4096 + 100, 16)].into_iter()).unwrap();
    assert_eq!(one.lendings.len(), 2, "the range and the one inside it");
    let wait = Duration::from_millis(10);
    assert!(!m.wait_unused(a, wait) && !m.wait_unused(a + 4096, wait));
    assert!(m.wait_unused(b, wait), "not overlapped");
    // Just past its end, and just before the next one.
    let none = m.take_uses([(a + (1 << 20), 16), (b - 16, 16)].into_iter());
    assert!(none.as_ref().unwrap().lendings.is_empty());
    m.release(none.unwrap());
    m.begin_unregister(a);
    assert!(matches!(m.take_uses([(a, 1)].into_iter()), Err(at) if at == a));
    // A second unregister call meanwhile; the first gives up: still
    // closed to new batches while the second waits.
    m.begin_unregister(a);
    m.end_unregister(a, false);
    assert!(
        m.take_uses([(a, 1)].into_iter()).is_err(),
        "reopened under the second"
    );
    m.release(one);
    assert!(m.wait_unused(a, wait));
    m.end_unregister(a, false);
    let again = m.take_uses([(a, 1)].into_iter()).unwrap();
    // Taken back while used (as a free does), and registered again:
    // the old use does not count the new registration down.
    m.lent_back(a);
    m.lending(a, 4096).unwrap();
    let new = m.take_uses([(a, 1)].into_iter()).unwrap();
    m.release(again);
    assert!(
        !m.wait_unused(a, wait),
        "the new registration's use was lost"
    );
    m.release(new);
    assert!(m.wait_unused(a, wait));
}

/// A batch that started before its memory was registered uses it all
/// the same: the registration is unused only once that batch ended,
/// whether the batch counted nothing (nothing was registered then) or
/// counted its ranges and found no registration.
#[test]
fn a_registration_counts_the_batches_already_in_flight_from_it() {
    let wait = Duration::from_millis(10);
    let (a, b) = (0x10_0000, 0x30_0000);
    // Nothing registered: the batch counts nothing.
    let m = ManagedBuffers::default();
    let early = m.take_uses([(a + 100, 16)].into_iter()).unwrap();
    m.lending(a, 4096).unwrap();
    assert!(!m.wait_unused(a, wait), "the uncounted batch was forgotten");
    m.release(early);
    assert!(m.wait_unused(a, wait));
    // Once nothing uncounted is left, later registrations do not wait.
    m.lending(b, 4096).unwrap();
    assert!(m.wait_unused(b, wait));
    // Something else registered: the batch counts its ranges.
    let m = ManagedBuffers::default();
    m.lending(b, 4096).unwrap();
    let early = m.take_uses([(a + 100, 16)].into_iter()).unwrap();
    let elsewhere = m.take_uses([(a + 8192, 16)].into_iter()).unwrap();
    m.lending(a, 4096).unwrap();
    assert!(!m.wait_unused(a, wait), "the batch in flight was forgotten");
    m.release(early);
    assert!(m.wait_unused(a, wait), "another range's batch counted");
    m.release(elsewhere);
    // A batch of no ranges counts nothing and keeps nothing.
    let none = m.take_uses(std::iter::empty()).unwrap();
    assert!(none.flight.is_none() && !none.unaccounted);
    assert!(m.live.lock().unwrap().flights.is_empty());
}
