package guestlib

import (
	"runtime/debug"

	"github.com/shuntnet/shunt/internal/fault"
)

// ErrRegionLost is what a call fails with when the memory of its
// connection's rings is gone: the region was truncated under the mapping
// (by a hostile peer, or by hostd taking the memory back after a flow lost
// its permission and its ends did not leave in time). The connection
// cannot go on; close it. (Before, the program died of SIGBUS.)
var ErrRegionLost = fault.ErrFault

// caught is deferred at the top of every Conn call that may touch ring
// memory, with the setting fault.Arm returned:
//
//	defer c.caught(fault.Arm(), "read", &err)
//
// A memory fault in the call (the region was truncated) is recovered and
// the call fails with ErrRegionLost; any other panic goes on. It costs a
// per-goroutine flag and a deferred call, no allocation
// (docs/BENCHMARKS.md). Calls that unlock without defer use fault.Do
// around the part that touches the rings instead, so no lock stays held.
func (c *Conn) caught(old bool, op string, err *error) {
	debug.SetPanicOnFault(old)
	x := recover()
	if x == nil {
		return
	}
	if _, ok := x.(interface{ Addr() uintptr }); !ok {
		panic(x)
	}
	c.regionLost(op)
	if err != nil {
		*err = c.opErr(op, ErrRegionLost)
	}
}

// regionLost reports, once per connection, that its rings' memory is gone.
func (c *Conn) regionLost(op string) {
	if c.lost.CompareAndSwap(false, true) && c.client != nil {
		c.client.logf("shunt: %s -> %s: %s: ring memory gone (the region was truncated); the connection fails", c.local, c.remote, op)
	}
}

// guarded runs fn, which touches ring memory and must not leave a lock
// held if it faults; a fault is reported like caught's.
func (c *Conn) guarded(op string, fn func()) {
	if fault.Do(fn) != nil {
		c.regionLost(op)
	}
}
