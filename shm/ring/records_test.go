package ring_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// recRing formats a ring of capacity c in plain memory and returns its
// memory and both record ends, stamping from epoch.
func recRing(t testing.TB, c int, epoch uint64) ([]byte, *ring.Ring, *ring.RecWriter, *ring.RecReader) {
	t.Helper()
	mem := shmtest.Aligned(ring.Size(c))
	if err := ring.Format(mem, c); err != nil {
		t.Fatal(err)
	}
	r, err := ring.Attach(mem, c)
	if err != nil {
		t.Fatal(err)
	}
	w, err := ring.NewRecWriter(r, epoch)
	if err != nil {
		t.Fatal(err)
	}
	rd, err := ring.NewRecReader(r, epoch)
	if err != nil {
		t.Fatal(err)
	}
	return mem, r, w, rd
}

// putRec writes a record header at data offset off, as a peer would.
func putRec(mem []byte, off, n, pad int, kind, tag uint8, stamp uint64) {
	h := mem[ring.HeaderSize+off:]
	binary.NativeEndian.PutUint32(h, uint32(n))
	h[4], h[5] = kind, tag
	binary.NativeEndian.PutUint16(h[6:], uint16(pad))
	binary.NativeEndian.PutUint64(h[8:], stamp)
}

func pat(n uint64, i int) byte { return byte(n*131 + uint64(i)*7 + uint64(i>>8)) }

// send reserves, fills with pat(k, i) and commits one record.
func send(t testing.TB, w *ring.RecWriter, k uint64, n int) {
	t.Helper()
	p, err := w.Reserve(n)
	if err != nil {
		t.Fatalf("Reserve(%d) for record %d: %v", n, k, err)
	}
	for i := range p {
		p[i] = pat(k, i)
	}
	if err := w.Commit(n, ring.RecKindData, uint8(k)); err != nil {
		t.Fatalf("Commit(%d): %v", n, err)
	}
}

// recv polls one record and checks it is record k of n bytes.
func recv(t testing.TB, rd *ring.RecReader, k uint64, n int) {
	t.Helper()
	rec, ok, err := rd.Poll()
	if err != nil || !ok {
		t.Fatalf("Poll for record %d = %v, %v; want a record", k, ok, err)
	}
	if len(rec.Payload) != n || rec.Tag != uint8(k) || rec.Kind != ring.RecKindData {
		t.Fatalf("record %d: %d bytes, tag %d, kind %d; want %d, %d, %d", k, len(rec.Payload), rec.Tag, rec.Kind, n, uint8(k), ring.RecKindData)
	}
	for i, b := range rec.Payload {
		if b != pat(k, i) {
			t.Fatalf("record %d byte %d = %d, want %d", k, i, b, pat(k, i))
		}
	}
	if err := rd.Consume(); err != nil {
		t.Fatal(err)
	}
}

// quick writes record k of 8 bytes, as send does, for setups and other
// goroutines (a failure shows in what the test reads).
func quick(w *ring.RecWriter, k uint64) {
	if p, err := w.Reserve(8); err == nil {
		for i := range p {
			p[i] = pat(k, i)
		}
		w.Commit(8, ring.RecKindData, uint8(k))
	}
}

// await returns once Poll has something to say: a Wait can end at a PAD,
// which Poll skips.
func await(t testing.TB, rd *ring.RecReader) {
	t.Helper()
	for {
		if _, ok, err := rd.Poll(); ok || err != nil {
			return
		}
		if err := rd.Wait(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatalf("waiting for a record: %v", err)
		}
	}
}

func noRecord(t testing.TB, rd *ring.RecReader, why string) {
	t.Helper()
	if rec, ok, err := rd.Poll(); ok || err != nil {
		t.Fatalf("%s: Poll = %d bytes, %v, %v; want nothing", why, len(rec.Payload), ok, err)
	}
}

// TestRecLayout pins the format to C's (shunt.h, struct shunt_rec,
// shunt_rec_pad, shunt_rec_span): the offsets, padding and stamps that a C
// end reads.
func TestRecLayout(t *testing.T) {
	for _, tt := range []struct{ hdr, n, pad int }{
		{0, 8, 0}, {0, 1023, 0}, {0, 1024, 48}, {24, 1024, 24}, {48, 2000, 0}, {100, 5000, 12},
	} {
		if got := ring.RecPadding(tt.hdr, tt.n); got != tt.pad {
			t.Errorf("RecPadding(%d, %d) = %d, want %d", tt.hdr, tt.n, got, tt.pad)
		}
	}
	for _, tt := range []struct{ n, span int }{{0, 64}, {48, 64}, {49, 128}, {48 + 2000, 2112}} {
		if got := ring.RecSpan(tt.n); got != tt.span {
			t.Errorf("RecSpan(%d) = %d, want %d", tt.n, got, tt.span)
		}
	}
	const epoch = 0xabc00000000
	mem, _, w, _ := recRing(t, 64<<10, epoch)
	p, _ := w.Reserve(8)
	copy(p, "abcdefgh")
	w.Commit(8, ring.RecKindData, 7)
	p, _ = w.Reserve(2000)
	p[0] = 0xee
	w.Commit(2000, ring.RecKindData, 9)
	d := mem[ring.HeaderSize:]
	ne := binary.NativeEndian
	if ne.Uint32(d) != 8 || d[4] != ring.RecKindData || d[5] != 7 || ne.Uint16(d[6:]) != 0 || ne.Uint64(d[8:]) != epoch || string(d[16:24]) != "abcdefgh" {
		t.Fatalf("first record's line: %x", d[:64])
	}
	if h := d[64:]; ne.Uint32(h) != 2000 || h[5] != 9 || ne.Uint16(h[6:]) != 48 || ne.Uint64(h[8:]) != epoch+1 || h[64] != 0xee {
		t.Fatalf("second record: header %x, first payload byte %x; want 2000 bytes after a 48-byte pad, stamp epoch+1", h[:16], h[64])
	}
	// The tail is published once per stride (an eighth of the ring: 8 KiB
	// here), not per record.
	if tail := ne.Uint64(mem[ring.OffTail:]); tail != 0 {
		t.Fatalf("tail = %d after 2176 bytes of records, want 0 (unpublished within the first stride)", tail)
	}
	for {
		p, _ = w.Reserve(1000)
		w.Commit(len(p), ring.RecKindData, 0)
		if _, bytes := w.Records(); bytes >= 8<<10 {
			if tail := ne.Uint64(mem[ring.OffTail:]); tail != bytes {
				t.Fatalf("tail = %d once the records crossed 8 KiB, want %d", tail, bytes)
			}
			return
		}
		if tail := ne.Uint64(mem[ring.OffTail:]); tail != 0 {
			t.Fatalf("tail = %d within the first stride, want 0", tail)
		}
	}
}

// TestRecStream: a writer and a reader goroutine move records of seeded
// random sizes (0 B to 16 KiB) through a 64 KiB ring; every record arrives
// once, in order, with its bytes, through wraps, PADs and a full ring.
func TestRecStream(t *testing.T) {
	n := uint64(100000)
	if testing.Short() {
		n = 10000
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	size := func(rng *rand.Rand) int {
		if rng.IntN(4) > 0 {
			return rng.IntN(200)
		}
		return rng.IntN(16 << 10)
	}
	_, r, w, rd := recRing(t, 64<<10, ring.NewRecEpoch())
	done := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(seed, 1))
		for k := uint64(0); k < n; k++ {
			m := size(rng)
			p, err := w.Reserve(m)
			for errors.Is(err, ring.ErrRingFull) {
				if err = w.Wait(time.Now().Add(10 * time.Second)); err == nil {
					p, err = w.Reserve(m)
				}
			}
			if err != nil {
				done <- err
				return
			}
			for i := range p {
				p[i] = pat(k, i)
			}
			if err := w.Commit(m, ring.RecKindData, uint8(k)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	rng := rand.New(rand.NewPCG(seed, 1))
	for k := uint64(0); k < n; k++ {
		await(t, rd)
		recv(t, rd, k, size(rng))
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	noRecord(t, rd, "after the last")
	st := r.Stats()
	if st.MsgsWritten <= n || st.Written != st.Read {
		t.Fatalf("stats %+v: want PADs (more publications than %d records) and all bytes read", st, n)
	}
}

// TestRecStale: a ring full of another epoch's records (an earlier flow's
// bytes); then, after a lap of one-line records, a large record whose
// payload holds, at every line where a one-line record will start a lap
// later, exactly that record's stamp: the reader never takes any of them
// for a new record.
func TestRecStale(t *testing.T) {
	const c, e = 64 << 10, 0x777700000000
	mem, _, w, rd := recRing(t, c, e)
	for off := 0; off < c; off += ring.RecLine {
		putRec(mem, off, 8, 0, ring.RecKindData, 0, 0x555500000000+uint64(off/ring.RecLine))
	}
	noRecord(t, rd, "an earlier flow's record")
	const lap = c / ring.RecLine
	for k := uint64(0); k < lap; k++ {
		send(t, w, k, 8)
		recv(t, rd, k, 8)
	}
	const big = 16 << 10
	pad := ring.RecPadding(0, big)
	span := ring.RecSpan(pad + big)
	p, err := w.Reserve(big)
	if err != nil {
		t.Fatal(err)
	}
	clear(p)
	for x := ring.RecLine; x < span; x += ring.RecLine {
		k := lap + 1 + (c+x-span)/ring.RecLine
		if at := x + 8 - ring.RecHeaderSize - pad; at+8 <= big {
			binary.NativeEndian.PutUint64(p[at:], e+uint64(k))
		}
	}
	w.Commit(big, ring.RecKindData, 0)
	if _, ok, err := rd.Poll(); !ok || err != nil {
		t.Fatalf("the large record: %v, %v", ok, err)
	}
	rd.Consume()
	for k := uint64(lap + 1); k < 3*lap; k++ {
		send(t, w, k, 8)
		recv(t, rd, k, 8)
		noRecord(t, rd, "stale bytes of this ring")
	}
}

// TestRecStaleSameEpoch: lines that hold, from before the writer started
// (an earlier writer with the same epoch, say), exactly the stamps the
// reader will wait for there: the writer clears each before the reader
// gets to it.
func TestRecStaleSameEpoch(t *testing.T) {
	const c, e = ring.MinCapacity, 0x123400000000
	mem, _, w, rd := recRing(t, c, e)
	for k := 1; k < c/ring.RecLine; k++ {
		putRec(mem, k*ring.RecLine, 8, 0, ring.RecKindData, 0xee, e+uint64(k))
	}
	for k := uint64(0); k < 3*c/ring.RecLine; k++ {
		send(t, w, k, 8)
		recv(t, rd, k, 8)
		noRecord(t, rd, "an earlier writer's record")
	}
}

func TestRecCorrupt(t *testing.T) {
	const c, e = ring.MinCapacity, 0x4200000000
	tests := []struct {
		name string
		prep func(mem []byte, w *ring.RecWriter, rd *ring.RecReader)
		op   func(w *ring.RecWriter, rd *ring.RecReader) error
	}{
		{"length beyond the ring", func(m []byte, _ *ring.RecWriter, _ *ring.RecReader) { putRec(m, 0, c+1, 0, 1, 0, e) }, poll},
		{"record past the ring's end", func(m []byte, _ *ring.RecWriter, _ *ring.RecReader) { putRec(m, 0, c-8, 0, 1, 0, e) }, poll},
		{"pad beyond the ring", func(m []byte, _ *ring.RecWriter, _ *ring.RecReader) { putRec(m, 0, 8, 0xffff, 1, 0, e) }, poll},
		{"unknown kind", func(m []byte, _ *ring.RecWriter, _ *ring.RecReader) { putRec(m, 0, 8, 0, 99, 0, e) }, poll},
		{"PAD at the ring's start", func(m []byte, _ *ring.RecWriter, _ *ring.RecReader) {
			putRec(m, 0, c-ring.RecHeaderSize, 0, ring.RecKindPad, 0, e)
		}, poll},
		{"PAD short of the ring's end", func(m []byte, w *ring.RecWriter, rd *ring.RecReader) {
			quick(w, 0)
			rd.Poll()
			rd.Consume()
			putRec(m, 64, 100, 0, ring.RecKindPad, 0, e+1)
		}, poll},
		{"head moves back", func(m []byte, w *ring.RecWriter, rd *ring.RecReader) {
			for k := uint64(0); k < c/ring.RecLine; k++ {
				quick(w, k)
			}
			quick(w, 64) // no room: the writer asks for the head
			rd.Poll()
			rd.Consume() // the reader answers: head 64
			quick(w, 64) // the writer has seen head 64, and filled the ring
			binary.NativeEndian.PutUint64(m[ring.OffHead:], 0)
		}, reserve},
		{"head beyond tail", func(m []byte, w *ring.RecWriter, _ *ring.RecReader) {
			for k := uint64(0); k < c/ring.RecLine; k++ {
				quick(w, k)
			}
			binary.NativeEndian.PutUint64(m[ring.OffHead:], 1<<40)
		}, reserve},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mem, _, w, rd := recRing(t, c, e)
			tt.prep(mem, w, rd)
			if err := tt.op(w, rd); !errors.Is(err, ring.ErrCorrupt) {
				t.Fatalf("got %v, want ErrCorrupt", err)
			}
		})
	}
}

func poll(_ *ring.RecWriter, rd *ring.RecReader) error { _, _, err := rd.Poll(); return err }

func reserve(w *ring.RecWriter, _ *ring.RecReader) error { _, err := w.Reserve(8); return err }

// Record ends start only on line boundaries (a ring the copy API used
// first may sit anywhere), with an epoch no stamp of which is 0.
func TestRecUnalignedStart(t *testing.T) {
	mem := shmtest.Aligned(ring.Size(ring.MinCapacity))
	ring.Format(mem, ring.MinCapacity)
	r, _ := ring.Attach(mem, ring.MinCapacity)
	binary.NativeEndian.PutUint64(mem[ring.OffTail:], 100)
	binary.NativeEndian.PutUint64(mem[ring.OffHead:], 3)
	if _, err := ring.NewRecWriter(r, 1); !errors.Is(err, ring.ErrCorrupt) {
		t.Errorf("NewRecWriter at tail 100: %v, want ErrCorrupt", err)
	}
	if _, err := ring.NewRecReader(r, 1); !errors.Is(err, ring.ErrCorrupt) {
		t.Errorf("NewRecReader at head 3: %v, want ErrCorrupt", err)
	}
	binary.NativeEndian.PutUint64(mem[ring.OffTail:], 0)
	binary.NativeEndian.PutUint64(mem[ring.OffHead:], 0)
	for _, e := range []uint64{0, 1 << 63, ^uint64(0)} {
		_, werr := ring.NewRecWriter(r, e)
		_, rerr := ring.NewRecReader(r, e)
		if werr == nil || rerr == nil {
			t.Errorf("epoch %#x: writer %v, reader %v; want both refused", e, werr, rerr)
		}
	}
	if e := ring.NewRecEpoch(); e == 0 || e>>63 != 0 {
		t.Errorf("NewRecEpoch() = %#x", e)
	}
}

// TestRecDrainAfterReset: after a reset (hostd's revocation) the writer
// stops and the reader still reads exactly what was written, then ErrReset.
func TestRecDrainAfterReset(t *testing.T) {
	_, r, w, rd := recRing(t, 64<<10, 0x99900000000)
	for k := uint64(0); k < 100; k++ {
		send(t, w, k, 300)
	}
	r.Reset(3)
	if _, err := w.Reserve(8); !errors.Is(err, ring.ErrReset) {
		t.Fatalf("Reserve after reset: %v, want ErrReset", err)
	}
	for k := uint64(0); k < 100; k++ {
		recv(t, rd, k, 300)
	}
	if _, ok, err := rd.Poll(); ok || !errors.Is(err, ring.ErrReset) {
		t.Fatalf("Poll after the drain = %v, %v; want ErrReset", ok, err)
	}
	wn, wb := w.Records()
	rn, rb := rd.Records()
	if wn != rn || wb != rb {
		t.Fatalf("reader at %d records, %d bytes; writer at %d, %d", rn, rb, wn, wb)
	}
}

func TestRecRefused(t *testing.T) {
	const c = 64 << 10
	mem, _, w, _ := recRing(t, c, 1<<40)
	if _, err := w.Reserve(c / 2); !errors.Is(err, ring.ErrRecTooLarge) {
		t.Errorf("Reserve(half the ring): %v, want ErrRecTooLarge", err)
	}
	if _, err := w.Reserve(c/2 - 64); err != nil {
		t.Errorf("Reserve(a record of exactly half the ring): %v", err)
	}
	mem[ring.OffRFlags] = ring.FlagReaderClosed
	if _, err := w.Reserve(8); !errors.Is(err, ring.ErrPeerClosed) {
		t.Errorf("Reserve after the reader closed: %v, want ErrPeerClosed", err)
	}
}

func TestRecFull(t *testing.T) {
	const c = ring.MinCapacity
	_, _, w, rd := recRing(t, c, 1<<40)
	for k := uint64(0); k < c/ring.RecLine; k++ {
		send(t, w, k, 8)
	}
	if _, err := w.Reserve(8); !errors.Is(err, ring.ErrRingFull) {
		t.Fatalf("Reserve in a full ring: %v, want ErrRingFull", err)
	}
	if err := w.Wait(time.Now().Add(time.Millisecond)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Wait on a full ring: %v, want the deadline", err)
	}
	recv(t, rd, 0, 8)
	if err := w.Wait(time.Now().Add(time.Second)); err != nil {
		t.Fatalf("Wait after a record was consumed: %v", err)
	}
	send(t, w, c/ring.RecLine, 8)
}

func TestRecBadCalls(t *testing.T) {
	_, _, w, rd := recRing(t, ring.MinCapacity, 1<<40)
	for _, tt := range []struct {
		name string
		err  error
	}{
		{"Commit without Reserve", w.Commit(0, ring.RecKindData, 0)},
		{"Consume without Poll", rd.Consume()},
		{"Reserve(-1)", func() error { _, err := w.Reserve(-1); return err }()},
		{"Commit beyond the reservation", func() error { w.Reserve(8); return w.Commit(9, ring.RecKindData, 0) }()},
		{"Commit a PAD", func() error { w.Reserve(8); return w.Commit(8, ring.RecKindPad, 0) }()},
		{"Commit after Cancel", func() error { w.Reserve(8); w.Cancel(); return w.Commit(8, ring.RecKindData, 0) }()},
	} {
		if !errors.Is(tt.err, ring.ErrBadCommit) {
			t.Errorf("%s: %v, want ErrBadCommit", tt.name, tt.err)
		}
	}
	noRecord(t, rd, "after refused commits")
}

func TestRecWait(t *testing.T) {
	_, r, w, rd := recRing(t, ring.MinCapacity, 1<<40)
	if err := rd.Wait(time.Now().Add(time.Millisecond)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Wait on an empty ring: %v, want the deadline", err)
	}
	go quick(w, 0)
	if err := rd.Wait(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatalf("Wait for a record: %v", err)
	}
	recv(t, rd, 0, 8)
	go r.Reset(1)
	if err := rd.Wait(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatalf("Wait for the reset: %v", err)
	}
	if _, _, err := rd.Poll(); !errors.Is(err, ring.ErrReset) {
		t.Fatalf("Poll after the reset: %v, want ErrReset", err)
	}
}

// The data path allocates nothing.
func TestRecNoAllocs(t *testing.T) {
	_, _, w, rd := recRing(t, 64<<10, 1<<40)
	allocs := testing.AllocsPerRun(1000, func() {
		p, _ := w.Reserve(8)
		p[0] = 1
		w.Commit(8, ring.RecKindData, 0)
		rd.Poll()
		rd.Consume()
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per record, want 0", allocs)
	}
}

// FuzzRecords: records written and read in fuzzed sizes and order come
// back as written (round trip), until a hostile peer rewrites headers,
// payloads or indices; from then on every call still returns a record
// inside the ring or a sentinel error, and never panics or loops.
func FuzzRecords(f *testing.F) {
	f.Add(uint64(7), []byte{0, 40, 2, 0, 1, 200, 3, 0, 2, 0, 2, 0})
	f.Add(uint64(0), []byte{4, 1, 2, 3, 4, 5, 6, 7, 8, 2, 0})
	f.Add(^uint64(0), []byte{0, 255, 0, 255, 1, 9, 2, 0, 5, 3, 9, 2, 0, 6, 1, 2, 0})
	f.Fuzz(func(t *testing.T, epoch uint64, ops []byte) {
		const c = ring.MinCapacity
		mem, r, w, rd := recRing(t, c, epoch&^(1<<63)|1)
		data := mem[ring.HeaderSize:]
		type sent struct {
			tag uint8
			b   []byte
		}
		var queue []sent
		hostile := false
		arg := func(i *int) byte {
			*i++
			if *i < len(ops) {
				return ops[*i]
			}
			return 0
		}
		for i := 0; i < len(ops); i++ {
			switch op := ops[i]; op % 8 {
			case 0, 1: // write a record
				n := int(arg(&i)) * 13 % 2500
				p, err := w.Reserve(n)
				if err != nil {
					if !anyOf(err, ring.ErrRingFull, ring.ErrRecTooLarge, ring.ErrCorrupt, ring.ErrReset, ring.ErrPeerClosed) {
						t.Fatalf("Reserve(%d): %v", n, err)
					}
					continue
				}
				for j := range p {
					p[j] = byte(i + j)
				}
				queue = append(queue, sent{uint8(i), bytes.Clone(p)})
				if err := w.Commit(n, ring.RecKindData, uint8(i)); err != nil {
					t.Fatalf("Commit(%d): %v", n, err)
				}
			case 2, 3: // read a record
				rec, ok, err := rd.Poll()
				if err != nil && !anyOf(err, ring.ErrCorrupt, ring.ErrReset) {
					t.Fatalf("Poll: %v", err)
				}
				if !hostile && !ok && (len(queue) > 0 || errors.Is(err, ring.ErrCorrupt)) {
					t.Fatalf("Poll = %v with %d records written and no hostile write", err, len(queue))
				}
				if !ok {
					continue
				}
				if len(rec.Payload) > c-ring.RecHeaderSize {
					t.Fatalf("a %d-byte record in a %d-byte ring", len(rec.Payload), c)
				}
				if !hostile {
					if len(queue) == 0 || rec.Tag != queue[0].tag || !bytes.Equal(rec.Payload, queue[0].b) {
						t.Fatalf("read tag %d, %d bytes; want the first of %d written", rec.Tag, len(rec.Payload), len(queue))
					}
					queue = queue[1:]
				}
				if err := rd.Consume(); err != nil {
					t.Fatalf("Consume: %v", err)
				}
			case 4: // a header at the reader's head, with the stamp it expects
				head := binary.NativeEndian.Uint64(mem[ring.OffHead:])
				next := binary.NativeEndian.Uint64(mem[ring.OffRMsgs:])
				n := int(arg(&i))<<8 | int(arg(&i))
				putRec(mem, int(head%c), n*int(arg(&i)), int(arg(&i))*int(arg(&i)), arg(&i)%4, 0, epoch&^(1<<63)|1+next)
				hostile = true
			case 5: // arbitrary bytes anywhere in the data
				at := (int(arg(&i))<<8 | int(arg(&i))) % c
				data[at] = arg(&i)
				hostile = true
			case 6: // the reader's head or the writer's tail rewritten
				v := uint64(arg(&i)) << (arg(&i) % 40)
				if op&8 != 0 {
					binary.NativeEndian.PutUint64(mem[ring.OffHead:], v)
				} else {
					binary.NativeEndian.PutUint64(mem[ring.OffTail:], v)
				}
				hostile = true
			case 7: // reset or reader closed: the writer stops, the reader drains
				if op&8 != 0 {
					r.Reset(1)
				} else {
					mem[ring.OffRFlags] = ring.FlagReaderClosed
				}
			}
		}
	})
}

func anyOf(err error, targets ...error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}

// TestRecIndexPerStride: record ends publish no index per record (a small
// record is the only line either writes): the head stays where it was
// while the reader consumes within a stride; a writer short of room asks
// for it (the "writer waiting" word), and the reader's next Consume, or
// its next Poll of an empty ring, publishes it and clears the request.
func TestRecIndexPerStride(t *testing.T) {
	const c, e = ring.MinCapacity, 0x4200000000
	ne := binary.NativeEndian
	for _, answer := range []string{"consume", "empty poll"} {
		t.Run(answer, func(t *testing.T) {
			mem, _, w, rd := recRing(t, c, e)
			for k := uint64(0); k < c/ring.RecLine; k++ {
				quick(w, k)
			}
			if _, _, err := rd.Poll(); err != nil {
				t.Fatal(err)
			}
			rd.Consume()
			if h := ne.Uint64(mem[ring.OffHead:]); h != 0 {
				t.Fatalf("head %d published after one record, want 0 (once per stride)", h)
			}
			if _, err := w.Reserve(8); !errors.Is(err, ring.ErrRingFull) {
				t.Fatalf("reserve in a ring the writer sees full: %v, want ErrRingFull", err)
			}
			if ne.Uint32(mem[ring.OffWWait:]) == 0 {
				t.Fatal("the writer short of room did not ask for the head")
			}
			want := uint64(2 * ring.RecLine)
			if answer == "consume" {
				rd.Poll()
				rd.Consume()
			} else {
				// Drain without crossing a stride, then poll the empty ring.
				mem2, _, w2, rd2 := recRing(t, c, e)
				mem, w, rd = mem2, w2, rd2
				quick(w, 0)
				rd.Poll()
				rd.Consume()
				ne.PutUint32(mem[ring.OffWWait:], 2) // a writer's request
				want = ring.RecLine
				if _, ok, err := rd.Poll(); ok || err != nil {
					t.Fatalf("poll of an empty ring: %v %v", ok, err)
				}
			}
			if h := ne.Uint64(mem[ring.OffHead:]); h != want {
				t.Fatalf("head %d published after the writer asked, want %d", h, want)
			}
			if ne.Uint32(mem[ring.OffWWait:]) != 0 {
				t.Fatal("the request was not cleared")
			}
			if _, err := w.Reserve(8); err != nil {
				t.Fatalf("reserve after the reader answered: %v", err)
			}
		})
	}
}
