// Package region is Shunt's shared-memory region format, version 1: the file
// (a /dev/shm file, a memfd, or an ivshmem BAR seen from a VM) that carries a
// trust group's flows.
//
//	0        header     4 KiB    magic, version, size, geometry, generation
//	4096     directory  slots x 128 B, rounded up to 4 KiB
//	heapOff  heap       ring pairs, allocated in 4 KiB chunks
//
// Each directory slot describes one flow: its state, generation, the two
// owners (guest ids), its tuple, and where its ring pair lies in the heap.
// hostd is the only legitimate writer of the header and the directory;
// guests only read them (but they can write the mapping, so every reader
// validates). The allocator's state is the directory itself: a restarted
// hostd rebuilds the heap map by scanning the slots (Pool), so there is no
// second copy to fall out of step.
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
