// Package preload holds the C side of Shunt's guest library, for unmodified
// programs: ring format v1 (ring.c), region format v1 (region.c) and
// control protocol v1 (proto.c), declared in shunt.h, all in csrc/. The LD_PRELOAD
// library and shunt-run that build on them are not written yet.
//
// The Go file here only carries the cross-language tests: they build the C
// test tool (xtest.c) with gcc and check, against the Go implementations,
// that both sides encode and decode the same frames and move the same bytes
// through one ring in shared memory, in both directions.
package preload
