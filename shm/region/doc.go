// Package region is Shunt's shared-memory region format, version 1: the file
// (a pair region in hostd's region_dir, a trust group's /dev/shm file, a
// memfd, or an ivshmem BAR seen from a VM) that carries flows.
//
//	0        header     4 KiB    magic, version, size, geometry, generation
//	4096     directory  slots x 128 B, rounded up to 4 KiB
//	heapOff  heap       ring pairs, allocated in 4 KiB chunks
//
// Each directory slot describes one flow: its state, generation, the two
// owners (guest ids), its tuple, and where its ring pair lies in the heap.
// hostd is the only legitimate writer of the header and the directory;
// guests only read them (but they can write the mapping, so every reader
// validates, and hostd never reads them back). hostd's truth is private: a
// Pool keeps the allocation table (each slot's state, generation, rings,
// owners; the heap bitmap) in hostd's memory and publishes it to the
// directory, and a Shadow keeps a copy in a root-only file for a restarted
// hostd to adopt (AdoptShadow). Files creates and reopens region files so
// that no other local user can plant one (O_EXCL, O_NOFOLLOW, fstat, and
// the shadow's record of the file's identity).
//
// A slot is published like a seqlock: hostd sets the state to Reserved,
// writes the fields, bumps the generation and sets Ready. A reader loads
// state and generation, copies the fields, and loads both again; a change
// means the copy is stale. The READY control message carries the generation,
// so a guest can tell a reused slot from its own flow.
//
// All numbers are little-endian; Shunt's hosts and guests share one
// architecture (x86-64 or arm64), which is also what makes the atomic words
// usable from both sides. See docs/region.md for the full layout.
package region
