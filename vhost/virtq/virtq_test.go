package virtq

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"
	"unsafe"
)

// A test guest: 64 KiB of memory at guest address 0x10000 (front-end
// address 0x7000_0000), a queue of 8 at its start.
const (
	gpa     = 0x10000
	va      = 0x70000000
	memSize = 64 << 10
	qsize   = 8
	descOff = 0
	availAt = 0x100
	usedAt  = 0x200
	bufAt   = 0x1000
)

type guest struct {
	mem []byte
	q   *Queue
}

func newGuest(t testing.TB, indirect bool) *guest {
	raw := make([]byte, memSize+64)
	off := int(-uintptr(unsafe.Pointer(&raw[0])) & 63)
	mem := raw[off : off+memSize]
	m, err := NewMemory([]Region{{GPA: gpa, VA: va, Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	d, a, u := Sizes(qsize)
	q, err := New(m, qsize, mem[descOff:descOff+d], mem[availAt:availAt+a], mem[usedAt:usedAt+u], 0, indirect)
	if err != nil {
		t.Fatal(err)
	}
	return &guest{mem: mem, q: q}
}

func (g *guest) desc(table, i int, addr uint64, n uint32, flags, next uint16) {
	b := g.mem[table+16*i:]
	binary.LittleEndian.PutUint64(b, addr)
	binary.LittleEndian.PutUint32(b[8:], n)
	binary.LittleEndian.PutUint16(b[12:], flags)
	binary.LittleEndian.PutUint16(b[14:], next)
}

// offer makes head available.
func (g *guest) offer(head uint16) {
	idx := binary.LittleEndian.Uint16(g.mem[availAt+2:])
	binary.LittleEndian.PutUint16(g.mem[availAt+4+2*int(idx%qsize):], head)
	binary.LittleEndian.PutUint16(g.mem[availAt+2:], idx+1)
}

func TestChainAndUsed(t *testing.T) {
	g := newGuest(t, true)
	g.desc(descOff, 0, gpa+bufAt, 10, DescFNext, 3)
	g.desc(descOff, 3, gpa+bufAt+100, 20, DescFNext|DescFWrite, 5)
	g.desc(descOff, 5, gpa+bufAt+200, 30, DescFWrite, 0)
	copy(g.mem[bufAt:], "0123456789")
	g.offer(0)
	c, ok, err := g.q.Pop()
	if err != nil || !ok {
		t.Fatalf("Pop: %v %v", ok, err)
	}
	if c.Head != 0 || c.ReadLen() != 10 || c.WriteLen() != 50 || len(c.W) != 2 {
		t.Fatalf("chain %+v", c)
	}
	got := make([]byte, 10)
	if Gather(got, c.R, 0) != 10 || string(got) != "0123456789" {
		t.Fatalf("gathered %q", got)
	}
	if n := Scatter(c.W, 15, []byte("abcdefghij")); n != 10 || string(g.mem[bufAt+115:bufAt+120]) != "abcde" || string(g.mem[bufAt+200:bufAt+205]) != "fghij" {
		t.Fatalf("scattered %d", n)
	}
	g.q.Push(c.Head, 25)
	if idx := binary.LittleEndian.Uint16(g.mem[usedAt+2:]); idx != 1 {
		t.Fatalf("used idx %d", idx)
	}
	if id, n := binary.LittleEndian.Uint32(g.mem[usedAt+4:]), binary.LittleEndian.Uint32(g.mem[usedAt+8:]); id != 0 || n != 25 {
		t.Fatalf("used elem %d %d", id, n)
	}
	if _, ok, err := g.q.Pop(); ok || err != nil {
		t.Fatalf("second Pop: %v %v", ok, err)
	}
}

func TestIndirect(t *testing.T) {
	g := newGuest(t, true)
	tbl := bufAt + 0x800
	g.desc(descOff, 2, gpa+uint64(tbl), 3*16, DescFIndirect, 0)
	g.desc(tbl, 0, gpa+bufAt, 44, DescFNext, 2)
	g.desc(tbl, 2, gpa+bufAt+64, 100, DescFNext, 1)
	g.desc(tbl, 1, gpa+bufAt+256, 64, DescFWrite, 0)
	g.offer(2)
	c, ok, err := g.q.Pop()
	if err != nil || !ok || c.ReadLen() != 144 || c.WriteLen() != 64 {
		t.Fatalf("indirect chain %+v %v %v", c, ok, err)
	}
}

// TestHostileChains: each rule a driver can break breaks the queue with
// ErrBroken, at once, without a panic or a hang, and stays broken.
func TestHostileChains(t *testing.T) {
	tbl := bufAt + 0x800
	cases := map[string]func(g *guest){
		"loop": func(g *guest) {
			g.desc(descOff, 0, gpa+bufAt, 8, DescFNext, 1)
			g.desc(descOff, 1, gpa+bufAt, 8, DescFNext, 0)
		},
		"self loop": func(g *guest) { g.desc(descOff, 0, gpa+bufAt, 8, DescFNext, 0) },
		"next out of table": func(g *guest) {
			g.desc(descOff, 0, gpa+bufAt, 8, DescFNext, qsize)
		},
		"address below memory":  func(g *guest) { g.desc(descOff, 0, gpa-8, 8, 0, 0) },
		"address beyond memory": func(g *guest) { g.desc(descOff, 0, gpa+memSize, 1, 0, 0) },
		"huge len":              func(g *guest) { g.desc(descOff, 0, gpa+bufAt, 0xffffffff, 0, 0) },
		"len past the end":      func(g *guest) { g.desc(descOff, 0, gpa+memSize-4, 8, 0, 0) },
		"address wraps":         func(g *guest) { g.desc(descOff, 0, ^uint64(0)-3, 8, 0, 0) },
		"readable after writable": func(g *guest) {
			g.desc(descOff, 0, gpa+bufAt, 8, DescFNext|DescFWrite, 1)
			g.desc(descOff, 1, gpa+bufAt, 8, 0, 0)
		},
		"nested indirect": func(g *guest) {
			g.desc(descOff, 0, gpa+uint64(tbl), 16, DescFIndirect, 0)
			g.desc(tbl, 0, gpa+uint64(tbl), 16, DescFIndirect, 0)
		},
		"indirect with next": func(g *guest) { g.desc(descOff, 0, gpa+uint64(tbl), 16, DescFIndirect|DescFNext, 1) },
		"indirect loop": func(g *guest) {
			g.desc(descOff, 0, gpa+uint64(tbl), 32, DescFIndirect, 0)
			g.desc(tbl, 0, gpa+bufAt, 8, DescFNext, 1)
			g.desc(tbl, 1, gpa+bufAt, 8, DescFNext, 0)
		},
		"indirect table huge":    func(g *guest) { g.desc(descOff, 0, gpa+uint64(tbl), 0xfffffff0, DescFIndirect, 0) },
		"indirect table ragged":  func(g *guest) { g.desc(descOff, 0, gpa+uint64(tbl), 17, DescFIndirect, 0) },
		"indirect table outside": func(g *guest) { g.desc(descOff, 0, gpa+memSize, 16, DescFIndirect, 0) },
	}
	for name, build := range cases {
		t.Run(name, func(t *testing.T) {
			g := newGuest(t, true)
			build(g)
			g.offer(0)
			done := make(chan error, 1)
			go func() {
				_, _, err := g.q.Pop()
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, ErrBroken) {
					t.Fatalf("Pop: %v, want ErrBroken", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Pop did not return in 5 s")
			}
			if _, _, err := g.q.Pop(); !errors.Is(err, ErrBroken) || g.q.Err() == nil {
				t.Fatalf("the queue is not broken for good: %v", err)
			}
		})
	}
}

func TestHostileRing(t *testing.T) {
	g := newGuest(t, false)
	binary.LittleEndian.PutUint16(g.mem[availAt+2:], qsize+1) // more available than the ring holds
	if _, _, err := g.q.Pop(); !errors.Is(err, ErrBroken) {
		t.Fatalf("avail idx ahead by %d: %v", qsize+1, err)
	}
	g = newGuest(t, false)
	g.offer(qsize) // a head beyond the table
	if _, _, err := g.q.Pop(); !errors.Is(err, ErrBroken) {
		t.Fatalf("head %d: %v", qsize, err)
	}
	g = newGuest(t, false)
	g.desc(descOff, 0, gpa+bufAt+0x800, 16, DescFIndirect, 0)
	g.offer(0)
	if _, _, err := g.q.Pop(); !errors.Is(err, ErrBroken) {
		t.Fatalf("indirect without the feature: %v", err)
	}
}

func TestMemoryOverlap(t *testing.T) {
	a, b := make([]byte, 4096), make([]byte, 4096)
	if _, err := NewMemory([]Region{{GPA: 0, VA: 0x10000, Mem: a}, {GPA: 2048, VA: 0x20000, Mem: b}}); err == nil {
		t.Fatal("overlapping guest addresses accepted")
	}
	if _, err := NewMemory([]Region{{GPA: 0, VA: 0x10000, Mem: a}, {GPA: 8192, VA: 0x10800, Mem: b}}); err == nil {
		t.Fatal("overlapping front-end addresses accepted")
	}
	if _, err := NewMemory([]Region{{GPA: ^uint64(0) - 100, VA: 0, Mem: a}}); err == nil {
		t.Fatal("a wrapping region accepted")
	}
}

// FuzzWalk: any descriptor table, available ring and indirect table the
// driver writes gives chains inside guest memory or ErrBroken, never a
// panic or a hang.
func FuzzWalk(f *testing.F) {
	seed := make([]byte, 16*qsize+2*qsize+32)
	binary.LittleEndian.PutUint64(seed, gpa+bufAt)
	binary.LittleEndian.PutUint32(seed[8:], 64)
	f.Add(seed, uint16(1), true)
	f.Add(make([]byte, 300), uint16(3), false)
	f.Fuzz(func(t *testing.T, data []byte, avail uint16, indirect bool) {
		g := newGuest(t, indirect)
		n := copy(g.mem[descOff:descOff+16*qsize], data)
		n += copy(g.mem[availAt+4:availAt+4+2*qsize], data[n:])
		copy(g.mem[bufAt+0x800:bufAt+0x1800], data[n:]) // indirect tables land here
		binary.LittleEndian.PutUint16(g.mem[availAt+2:], avail)
		lo, hi := addrOf(g.mem), addrOf(g.mem)+uintptr(len(g.mem))
		for i := 0; i < qsize+1; i++ {
			c, ok, err := g.q.Pop()
			if err != nil {
				if !errors.Is(err, ErrBroken) {
					t.Fatalf("error %v is not ErrBroken", err)
				}
				return
			}
			if !ok {
				return
			}
			for _, s := range append(c.R, c.W...) {
				if len(s) > 0 && (addrOf(s) < lo || addrOf(s)+uintptr(len(s)) > hi) {
					t.Fatalf("a segment outside guest memory")
				}
			}
			g.q.Push(c.Head, uint32(c.WriteLen()))
		}
	})
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }
