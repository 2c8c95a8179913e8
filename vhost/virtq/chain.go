package virtq

import (
	"encoding/binary"
	"fmt"
)

// Chain is one descriptor chain, validated: its device-readable buffers
// (R) and then its device-writable ones (W), each inside guest memory.
type Chain struct {
	Head uint16
	R, W [][]byte
}

// ReadLen and WriteLen are the bytes of R and W.
func (c Chain) ReadLen() int  { return Total(c.R) }
func (c Chain) WriteLen() int { return Total(c.W) }

// Total is the bytes of segments.
func Total(bs [][]byte) int {
	n := 0
	for _, b := range bs {
		n += len(b)
	}
	return n
}

// desc is one descriptor, copied out of guest memory once, so the driver
// cannot change it between the check and the use.
type desc struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func readDesc(table []byte, i uint16) desc {
	b := table[int(i)*DescSize:]
	return desc{binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint32(b[8:]), binary.LittleEndian.Uint16(b[12:]), binary.LittleEndian.Uint16(b[14:])}
}

// walk follows the chain at head: at most size descriptors in the table
// (more is a loop), at most one indirect table (virtio 1.2 §2.7.5.3.1: not
// inside an indirect table, not together with NEXT), its entries at most
// len/16 and MaxSize, readable buffers before writable ones.
func (q *Queue) walk(head uint16) (Chain, error) {
	c := Chain{Head: head}
	table, n := q.desc, int(q.size)
	i, seen, indirect := head, 0, false
	for {
		if seen++; seen > n {
			return Chain{}, fmt.Errorf("longer than its table (%d descriptors): a loop", n)
		}
		d := readDesc(table, i)
		if d.flags&DescFIndirect != 0 {
			switch {
			case !q.indirect:
				return Chain{}, fmt.Errorf("indirect descriptor without VIRTIO_RING_F_INDIRECT_DESC")
			case indirect:
				return Chain{}, fmt.Errorf("indirect descriptor inside an indirect table")
			case d.flags&DescFNext != 0:
				return Chain{}, fmt.Errorf("indirect descriptor with NEXT")
			case d.len == 0 || d.len%DescSize != 0 || d.len/DescSize > MaxSize:
				return Chain{}, fmt.Errorf("indirect table of %d bytes", d.len)
			}
			t, err := q.mem.Slice(d.addr, uint64(d.len))
			if err != nil {
				return Chain{}, fmt.Errorf("indirect table: %w", err)
			}
			table, n, i, seen, indirect = t, int(d.len/DescSize), 0, 0, true
			continue
		}
		b, err := q.mem.Slice(d.addr, uint64(d.len))
		if err != nil {
			return Chain{}, fmt.Errorf("descriptor %d: %w", i, err)
		}
		if d.flags&DescFWrite != 0 {
			c.W = append(c.W, b)
		} else {
			if len(c.W) > 0 {
				return Chain{}, fmt.Errorf("descriptor %d: readable after writable", i)
			}
			c.R = append(c.R, b)
		}
		if d.flags&DescFNext == 0 {
			return c, nil
		}
		if int(d.next) >= n {
			return Chain{}, fmt.Errorf("descriptor %d: next %d out of a table of %d", i, d.next, n)
		}
		i = d.next
	}
}

// Gather copies up to len(dst) bytes from segs, starting skip bytes in,
// and returns how many it copied.
func Gather(dst []byte, segs [][]byte, skip int) int {
	n := 0
	for _, s := range segs {
		if skip >= len(s) {
			skip -= len(s)
			continue
		}
		n += copy(dst[n:], s[skip:])
		skip = 0
		if n == len(dst) {
			break
		}
	}
	return n
}

// Scatter copies src into segs, starting skip bytes in, and returns how
// many bytes it copied.
func Scatter(segs [][]byte, skip int, src []byte) int {
	n := 0
	for _, s := range segs {
		if skip >= len(s) {
			skip -= len(s)
			continue
		}
		n += copy(s[skip:], src[n:])
		skip = 0
		if n == len(src) {
			break
		}
	}
	return n
}
