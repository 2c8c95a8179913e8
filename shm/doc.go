// Package shm is the root of Shunt's shared-memory data path. The work is in
// its sub-packages:
//
//	region  the region file: header, flow directory, heap, and the Pool that
//	        allocates ring pairs (hostd's side)
//	ring    the SPSC byte-stream ring with copy and zero-copy APIs
//	wait    spin, block and adaptive waiting, and the futex Signal
//	shmtest shared memory for tests
//
// This package holds no code of its own; its tests and benchmarks run the
// sub-packages across two real processes that map one memfd.
package shm
