// Package ring is Shunt's single-producer single-consumer byte-stream ring,
// laid out in memory that the two ends share and neither trusts.
//
// A ring is a 1 KiB header followed by a power-of-two data area:
//
//	off    line        written by     fields
//	0      config      hostd, once    magic, capacity
//	128    producer    writer         tail (bytes written), msgs written, FIN
//	256    consumer    reader         head (bytes read), msgs read
//	384    waiters     both           reader-waiting, writer-waiting
//	512    control     hostd or ends  RESET, reason; reader-closed
//	1024   data        writer         capacity bytes, byte i at (i mod capacity)
//
// Indices are free-running 64-bit byte counts, so they double as the byte
// counters that hostd reads for metrics; a ring never wraps its counters in
// practice (2^64 bytes). Each end keeps its own index privately and only
// publishes it: it never re-reads its own index from shared memory, and it
// checks the peer's index on every load (it may only grow, and never by more
// than the free space). A peer that breaks these rules gets ErrCorrupt; the
// local end never reads or writes outside the window, loops or panics.
//
// Ordering: Go's sync/atomic operations are sequentially consistent. The
// writer fills data, then stores tail; the reader loads tail, then reads data,
// so data written before a tail store is visible after a tail load. The
// waiting flags follow the Dekker pattern: the reader stores waiting=1 and
// then loads tail; the writer stores tail and then loads waiting; at least one
// of them sees the other's store, so no wake-up is lost.
//
// The non-blocking operations (TryWrite, TryRead, Reserve/Commit, Peek/Release)
// are on Writer and Reader; the blocking ones (Write, Read with deadlines) add
// a wait.Waiter. A Writer is for one goroutine at a time, a Reader likewise.
package ring
