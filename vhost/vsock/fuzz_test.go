package vsock

import (
	"testing"
)

// FuzzPackets feeds any sequence of tx packets (headers and payloads as a
// guest's driver could write them) to a device with a listener, a
// catch-all listener and no rx queue: nothing panics, and every bound
// holds (connections, queued RSTs, each receive buffer within its credit).
func FuzzPackets(f *testing.F) {
	mk := func(op uint16, src uint64, sport, dport uint32, payload int) []byte {
		b := make([]byte, HdrSize+payload)
		Hdr{SrcCID: src, DstCID: HostCID, SrcPort: sport, DstPort: dport, Type: TypeStream, Op: op, Len: uint32(payload), BufAlloc: 4096}.Put(b)
		return b
	}
	cat := func(ps ...[]byte) []byte {
		var out []byte
		for _, p := range ps {
			out = append(out, byte(len(p)), byte(len(p)>>8))
			out = append(out, p...)
		}
		return out
	}
	f.Add(cat(mk(OpRequest, 9, 1, 80, 0), mk(OpRW, 9, 1, 80, 100), mk(OpShutdown, 9, 1, 80, 0)))
	f.Add(cat(mk(OpRequest, 9, 1, 81, 0), mk(OpRW, 9, 1, 81, 3), mk(OpCreditRequest, 9, 1, 81, 0), mk(OpRst, 9, 1, 81, 0)))
	f.Add(cat(mk(OpRW, 9, 7, 7, 0), mk(OpRequest, 3, 1, 80, 0), mk(OpResponse, 9, 1, 80, 0)))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := New(9, nil)
		if err != nil {
			t.Fatal(err)
		}
		l, _ := d.Listen(80)
		defer l.Close()
		a, _ := d.ListenAny(func(p uint32) bool { return p%2 == 1 })
		defer a.Close()
		hdr := make([]byte, HdrSize)
		d.mu.Lock()
		defer d.mu.Unlock()
		for len(data) >= 2 {
			n := int(data[0]) | int(data[1])<<8
			data = data[2:]
			n = min(n, len(data))
			pkt := data[:n]
			data = data[n:]
			// Split the packet in two buffers, as Linux's older drivers
			// put the header and the payload in descriptors of their own.
			cut := min(len(pkt), HdrSize)
			d.packet([][]byte{pkt[:cut], pkt[cut:]}, hdr)
			if len(d.conns) > MaxConns || len(d.loose) > maxLoose || len(d.ready) > MaxConns+1 {
				t.Fatalf("%d connections, %d RSTs queued", len(d.conns), len(d.loose))
			}
			for _, c := range d.conns {
				if c.in.len() > RecvBuf || c.out.len() > SendBuf {
					t.Fatalf("connection %v holds %d/%d bytes", c.k, c.in.len(), c.out.len())
				}
			}
		}
	})
}

// FuzzHdr: a header decodes from any 44 bytes and encodes back to them.
func FuzzHdr(f *testing.F) {
	f.Add(make([]byte, HdrSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseHdr(b)
		if len(b) < HdrSize {
			if err == nil {
				t.Fatal("a short header parsed")
			}
			return
		}
		out := make([]byte, HdrSize)
		h.Put(out)
		if string(out) != string(b[:HdrSize]) {
			t.Fatalf("%x encodes back to %x", b[:HdrSize], out)
		}
	})
}
