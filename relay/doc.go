// Package relay is the cross-host data plane (issue 23,
// docs/crosshost.md): what carries a connection's bytes between two hosts
// once both hosts' hostds have paired it.
//
// Built so far: the link between two hosts' relays (link.go, frame.go). A
// Link multiplexes many flows over a few TCP connections. Each flow is
// pinned to one connection, so its bytes stay in order; each has its own
// credit window, granted by the receiver as its consumer takes bytes, so
// a slow reader never stalls the other flows (the receiving side buffers
// at most a window per flow and never blocks its connection's reader).
// Frames are batched: a connection's writer drains every queued frame
// into one buffered write, so small messages share a system call and a
// stream goes out in large writes. A flow's end marks travel in order
// with its bytes: DOWN(reason) and LEFT(final offset).
//
// The receiver's consumption is acknowledged end to end: Flow.Acked is the
// stream offset the peer's consumer has taken. The relay is meant to free
// a byte in the sending guest's ring only once it is acknowledged (the
// receiving host's ring holds it), so that a link cut loses nothing: both
// guests downgrade to TCP at the acknowledged offsets.
//
// Not built yet: the relay as the local guest's ring peer (the region it
// shares with that guest, READY, attach, the start and left marks), the
// pairing across hosts that gives two relays a flow id, and the process
// it runs in. Everything a peer relay sends is checked as untrusted input
// (frame.go): unknown types, oversized frames, bytes beyond the granted
// credit or out of order end the link.
package relay
