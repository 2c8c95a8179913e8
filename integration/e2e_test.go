package integration

import (
	"bytes"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"testing"
	"time"
)

// TestFastPath256MiB: an allowed connection reaches the fast path on both
// ends (it starts on TCP) and moves 256 MiB with matching checksums, all
// through the rings; hostd lists the flow with the bytes the rings counted.
func TestFastPath256MiB(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5201)
	settle(t, c, true, 5*time.Second)
	settle(t, s, true, 5*time.Second)
	const total = 256 << 20
	src := rand.NewChaCha8([32]byte{1})
	var sent uint32
	errc := make(chan error, 1)
	go func() {
		buf := make([]byte, 1<<20)
		for left := total; left > 0; left -= len(buf) {
			src.Read(buf)
			sent = crc32.Update(sent, crc32.IEEETable, buf)
			if _, err := c.Write(buf); err != nil {
				errc <- err
				return
			}
		}
		errc <- c.CloseWrite()
	}()
	h := crc32.NewIEEE()
	n, err := io.Copy(h, s)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("writer: %v", err)
	}
	if n != total || h.Sum32() != sent {
		t.Fatalf("received %d bytes crc %08x; want %d crc %08x", n, h.Sum32(), total, sent)
	}
	// And back the other way, on the same flow.
	if _, err := s.Write([]byte("done")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, []byte("done")) {
		t.Fatalf("reply %q, %v", got, err)
	}
	if st := c.Stats(); st.RingSent != total || st.TCPSent != 0 {
		t.Fatalf("client %+v, want all %d bytes on the ring", st, total)
	}
	fl := e.flows()
	if len(fl) != 1 || fl[0].GuestA != "g1" || fl[0].GuestB != "g2" || fl[0].BytesAB != total || fl[0].BytesBA != 4 {
		t.Fatalf("hostd flows = %+v; want one g1->g2 flow with %d and 4 bytes", fl, total)
	}
}
