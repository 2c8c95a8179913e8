// Package fault turns a memory fault on shared memory into an error.
//
// A region is a file that another process (a guest, a peer) can truncate
// while it is mapped here: every access to a page past the new end then
// raises SIGBUS, which kills a Go program. hostd and the Go guest library
// arm the runtime's panic-on-fault (runtime/debug.SetPanicOnFault) around
// each call that touches ring or region memory, and Catch turns the fault
// into ErrFault for that call alone:
//
//	func (x *T) Op() (err error) {
//		defer fault.Catch(fault.Arm(), &err)
//		... touch shared memory ...
//	}
//
// The guard is a per-goroutine flag and a deferred call: no allocation,
// a few nanoseconds (docs/BENCHMARKS.md). Any other panic goes on.
package fault
