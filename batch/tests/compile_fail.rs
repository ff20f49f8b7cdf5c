//! Misuse that must not compile: touching a buffer owned by an in-flight
//! batch, using a submitted batch, taking buffers out of a ticket.

#[test]
fn ownership_misuse_does_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
