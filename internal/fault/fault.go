package fault

import (
	"errors"
	"runtime/debug"
)

// ErrFault means shared memory faulted under an access: its file was
// truncated (by a guest, by a peer, or by hostd revoking the region), so
// the memory is gone. The flows in it cannot go on.
var ErrFault = errors.New("shunt: shared memory gone (the region was truncated or revoked)")

// Arm makes a memory fault in this goroutine panic instead of killing the
// process, and returns the previous setting for Catch.
func Arm() bool { return debug.SetPanicOnFault(true) }

// Catch must be deferred directly (defer fault.Catch(fault.Arm(), &err)):
// it restores the setting Arm returned and, if the call panicked with a
// memory fault, recovers and sets *err to ErrFault. Other panics go on.
func Catch(old bool, err *error) {
	debug.SetPanicOnFault(old)
	x := recover()
	if x == nil {
		return
	}
	if _, ok := x.(interface{ Addr() uintptr }); !ok {
		panic(x)
	}
	if err != nil {
		*err = ErrFault
	}
}

// Do runs fn with faults caught: ErrFault if it faulted.
func Do(fn func()) (err error) {
	defer Catch(Arm(), &err)
	fn()
	return nil
}
