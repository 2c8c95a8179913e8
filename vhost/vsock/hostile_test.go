//go:build linux

package vsock_test

import (
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// waitFor polls cond for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5 s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// stillServes checks that the device serves an honest guest afterwards:
// the hostile front-end goes, a new one attaches to the same device, and
// a guest connection to a listener is answered.
func stillServes(t *testing.T, f *fake) {
	t.Helper()
	f.fe.Close()
	select {
	case <-f.done:
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after the hostile front-end closed")
	}
	g := attach(t, f.dev)
	l, err := f.dev.Listen(4242)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	g.sendPkt(hdr(vsock.OpRequest, 1, 4242), nil)
	g.expect(vsock.OpResponse)
}

// TestHostileDriver: a guest driver that writes descriptor loops,
// addresses outside its memory, huge lengths, lying packet headers, data
// beyond its credit, another CID, or a flood of connections cannot crash
// or stall the device: the bad queue or connection stops, the rest of the
// device keeps serving, and a new front-end is served.
func TestHostileDriver(t *testing.T) {
	brokenTx := map[string]func(f *fake){
		"descriptor loop": func(f *fake) {
			f.desc(txAt, 0, gpa+txBufAt, 64, 1, 1)
			f.desc(txAt, 1, gpa+txBufAt, 64, 1, 0)
		},
		"address beyond memory": func(f *fake) { f.desc(txAt, 0, gpa+memSize, 64, 0, 0) },
		"address below memory":  func(f *fake) { f.desc(txAt, 0, gpa-4096, 64, 0, 0) },
		"huge len":              func(f *fake) { f.desc(txAt, 0, gpa+txBufAt, 0xffffffff, 0, 0) },
		"indirect table loop": func(f *fake) {
			f.desc(txAt, 0, gpa+txBufAt, 32, 4, 0)
			f.desc(txBufAt, 0, gpa+txBufAt+64, 64, 1, 1)
			f.desc(txBufAt, 1, gpa+txBufAt+64, 64, 1, 0)
		},
		"available index ahead": func(f *fake) {
			binary.LittleEndian.PutUint16(f.mem[txAt+0x400+2:], qn+5)
		},
	}
	for name, build := range brokenTx {
		t.Run("tx "+name, func(t *testing.T) {
			f := newFake(t)
			build(f)
			if name != "available index ahead" {
				f.offer(txAt, 0)
			}
			f.kickQ(1)
			waitFor(t, "tx queue broken", func() bool { return f.dev.Stats().QueueBroken.Load() == 1 })
			if v := make([]byte, 8); func() bool { n, _ := f.errs[1].Read(v); return n != 8 }() {
				t.Fatal("the tx queue's error eventfd was not signalled")
			}
			stillServes(t, f)
		})
	}
	t.Run("rx buffer beyond memory", func(t *testing.T) {
		f := newFake(t)
		// Every posted buffer is taken; the next the driver posts is bad.
		for i := 0; i < qn; i++ {
			f.sendPkt(hdr(vsock.OpRequest, uint32(100+i), 1), nil)
			f.expect(vsock.OpRst)
		}
		f.rxPosted = 0
		f.desc(rxAt, 0, gpa+memSize-10, 4096, 2, 0)
		f.sendPkt(hdr(vsock.OpRequest, 99, 1), nil)
		waitFor(t, "rx queue broken", func() bool { return f.dev.Stats().QueueBroken.Load() == 1 })
		stillServes(t, f)
	})
	t.Run("header len beyond its buffer", func(t *testing.T) {
		f := newFake(t)
		c := f.connected(5, 1)
		pkt := make([]byte, vsock.HdrSize+10)
		h := hdr(vsock.OpRW, 5, 1)
		h.Put(pkt)
		binary.LittleEndian.PutUint32(pkt[24:], 0xffffffff) // len
		f.sendRaw(pkt)
		f.expect(vsock.OpRst)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, io.EOF) {
			t.Fatalf("read on the reset connection: %v, want its error", err)
		}
		if f.dev.Stats().BadPackets.Load() != 1 || f.dev.Stats().QueueBroken.Load() != 0 {
			t.Fatalf("bad packets %d, broken queues %d", f.dev.Stats().BadPackets.Load(), f.dev.Stats().QueueBroken.Load())
		}
		stillServes(t, f)
	})
	t.Run("data beyond credit", func(t *testing.T) {
		f := newFake(t)
		c := f.connected(5, 1)
		chunk := make([]byte, 4096)
		for i := 0; i <= vsock.RecvBuf/len(chunk); i++ {
			f.sendPkt(hdr(vsock.OpRW, 5, 1), chunk)
		}
		f.expect(vsock.OpRst)
		if f.dev.Stats().Resets.Load() != 1 {
			t.Fatalf("resets %d", f.dev.Stats().Resets.Load())
		}
		c.Close()
		stillServes(t, f)
	})
	t.Run("another source CID", func(t *testing.T) {
		f := newFake(t)
		l, _ := f.dev.Listen(1)
		defer l.Close()
		h := hdr(vsock.OpRequest, 5, 1)
		h.SrcCID = guestCID + 1
		f.sendPkt(h, nil)
		waitFor(t, "dropped", func() bool { return f.dev.Stats().BadPackets.Load() == 1 })
		if _, _, ok := f.recv(100 * time.Millisecond); ok || f.dev.Stats().Conns.Load() != 0 {
			t.Fatal("a packet from another CID was answered")
		}
		stillServes(t, f)
	})
	t.Run("another destination CID", func(t *testing.T) {
		// Another VM's CID: the device routes only to the host, so the
		// guest reaches nothing but the host's listeners.
		f := newFake(t)
		l, _ := f.dev.Listen(1)
		defer l.Close()
		h := hdr(vsock.OpRequest, 5, 1)
		h.DstCID = guestCID + 1
		f.sendPkt(h, nil)
		f.expect(vsock.OpRst)
		if f.dev.Stats().Conns.Load() != 0 || f.dev.Stats().BadPackets.Load() != 1 {
			t.Fatalf("conns %d, bad packets %d", f.dev.Stats().Conns.Load(), f.dev.Stats().BadPackets.Load())
		}
		stillServes(t, f)
	})
	t.Run("connection flood", func(t *testing.T) {
		f := newFake(t)
		l, _ := f.dev.Listen(1)
		defer l.Close()
		for i := 0; i < vsock.Backlog+50; i++ {
			f.sendPkt(hdr(vsock.OpRequest, uint32(1000+i), 1), nil)
			f.recv(time.Second)
		}
		if n := f.dev.Stats().Conns.Load(); n != vsock.Backlog {
			t.Fatalf("%d connections held for an accept that never comes, want the backlog, %d", n, vsock.Backlog)
		}
		if n := f.dev.Stats().Refused.Load(); n != 50 {
			t.Fatalf("%d refused, want 50", n)
		}
		stillServes(t, f)
	})
}

// TestMemTableBeyondFD: a SET_MEM_TABLE whose region reaches past its fd's
// end (or wraps) is refused: the back-end never maps beyond the files it
// was handed, and keeps its old table.
func TestMemTableBeyondFD(t *testing.T) {
	f := newFake(t)
	mf, err := sys.Memfd("small", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer mf.Close()
	for _, r := range [][3]uint64{{1 << 17, 0}, {1 << 16, 4096}, {4096, ^uint64(0) - 100}} {
		table := make([]byte, 8+32)
		binary.LittleEndian.PutUint32(table, 1)
		binary.LittleEndian.PutUint64(table[8:], gpa)
		binary.LittleEndian.PutUint64(table[16:], r[0]) // size
		binary.LittleEndian.PutUint64(table[24:], va)
		binary.LittleEndian.PutUint64(table[32:], r[1]) // mmap_offset
		f.write(5, 1|8, table, []int{int(mf.Fd())})
		if ack := binary.LittleEndian.Uint64(f.reply(5)); ack == 0 {
			t.Fatalf("a region of %#x bytes at offset %#x of a 64 KiB fd was accepted", r[0], r[1])
		}
	}
	l, _ := f.dev.Listen(1)
	defer l.Close()
	f.sendPkt(hdr(vsock.OpRequest, 5, 1), nil)
	f.expect(vsock.OpResponse)
}

// TestKickFlood: a driver that keeps its tx queue full and kicks for every
// packet keeps at most one extra pass of the device pending: the
// goroutines stay few.
func TestKickFlood(t *testing.T) {
	f := newFake(t)
	h := hdr(vsock.OpRW, 5, 1)
	h.SrcCID = guestCID + 1 // dropped without an answer: no rx needed
	base := runtime.NumGoroutine()
	most := 0
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); {
		for i := 0; i < 32; i++ {
			f.sendPkt(h, nil)
		}
		most = max(most, runtime.NumGoroutine()-base)
	}
	t.Logf("%d packets, at most %d goroutines more than at the start", f.dev.Stats().BadPackets.Load(), most)
	if most > 10 {
		t.Fatalf("%d goroutines more than at the start under a kick flood", most)
	}
	stillServes(t, f)
}
