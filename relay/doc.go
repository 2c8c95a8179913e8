// Package relay is the cross-host data plane (issue 23,
// docs/crosshost.md): what carries a connection's bytes between two hosts
// once both hosts' hostds have paired it.
//
// Built so far: the link between two hosts' relays, in two transports
// behind one interface (Carrier, carrier.go) with one flow engine
// (flows.go): over TCP (link.go, frame.go) and over RDMA verbs (rdma.go,
// verbs.go; the C shim is relay/ibv, docs/rdma.md). The TCP link: a
// Link multiplexes many flows over a few TCP connections. Each flow is
// pinned to one connection, so its bytes stay in order; each has its own
// credit window, granted by the receiver as its consumer takes bytes, so
// a slow reader never stalls the other flows (the receiving side buffers
// at most a window per flow and never blocks its connection's reader).
// Frames are batched: whoever writes a connection (a bridge's sender
// itself, non-blocking, or the connection's writer goroutine for what
// the socket did not take at once) takes every queued frame into one
// vectored write, so small messages share a system call and a stream
// goes out in large writes. A link reader hands a bridge's bytes
// straight into its guest's ring while the bridge waits for them
// (Flow's sink), with no hand-off to another goroutine. A flow's end marks travel in order
// with its bytes: DOWN(reason) and LEFT(final offset); on a vsock
// stretch, hostd's ATTACHED tells the VM's bridge that the ring its bytes
// go into is attached (vsock.go, HelloHold).
//
// The receiver's consumption is acknowledged end to end: Flow.Acked is the
// stream offset the peer's consumer has taken. The relay is meant to free
// a byte in the sending guest's ring only once it is acknowledged (the
// receiving host's ring holds it), so that a link cut loses nothing: both
// guests downgrade to TCP at the acknowledged offsets.
//
// The relay's ring peer is built too, as a library (bridge*.go): a Bridge
// joins one side of a ring pair in a region shared with a local guest to
// a Flow. It reads the ring the guest writes and frees its bytes only once
// the peer acknowledged them; it writes what the Flow brings into the ring
// the guest reads, taking from the Flow only as the ring has room; Stop
// marks the read ring left and says where its stretch ended (X), for the
// other host's RESUME (notes/relayed-flows.md).
//
// Not built yet: the pairing across hosts that gives two relays a flow
// id, hostd's wiring of bridges, and the process it runs in. Everything a
// peer relay sends is checked as untrusted input (frame.go): unknown
// types, oversized frames, bytes beyond the granted credit or out of
// order end the link; everything a guest writes in its rings is checked
// as the ring package checks it, and stops only that guest's bridge.
package relay
