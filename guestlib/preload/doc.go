// Package preload holds Shunt's guest side for unmodified programs:
// libshunt-preload.so, an LD_PRELOAD library in C, and shunt-run, the
// script that runs a program under it (docs/preload.md).
//
// The library is the C core in guestlib/c (rings, region, control protocol,
// the session with hostd, VM discovery and kicks; shunt.h), which the Open
// MPI transport (guestlib/mpi) links too, plus the interposition files in csrc/: the
// fd table and configuration (preload.c, preload.h), sockets (socket.c),
// I/O (io.c), poll and select (wait.c), epoll (epoll.c), hostd's side of
// connections (conn.c), OPEN after the open delay and the request-id index
// (open.c), close, dup, exec and exit (lifetime.c), fork (fork.c), and the
// safety net that resets a flow
// whose kernel socket receives bytes written past the library, plus
// io_uring detection (guard.c). The C files sit in csrc/ because the
// go command refuses C files in a package that does not use cgo.
//
// Build them with make preload (into bin/); make ctest builds the C test
// programs. Both use the Makefile's one set of compiler flags, and so do
// the tests, which build through those targets.
//
// The Go files here only carry the core's tests: they build the C test tool
// (guestlib/c/xtest) and check, against the Go implementations, that both
// sides encode and decode the same frames, name the same reasons, and move
// the same bytes through one ring in shared memory, in both directions;
// and they run the C tests of the core's records in a ring (records.c),
// which only C uses. The library itself is tested with real programs in
// integration/preload_test.go.
package preload
