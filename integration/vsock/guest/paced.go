//go:build linux

package main

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// got is what a reader took from a connection: its length and SHA-256,
// and how it ended (nil at EOF).
type got struct {
	n   int64
	sum []byte
	err error
}

// readAll reads c to its end in the background, hashing what comes;
// eof (if not nil) is closed when the read ends.
func readAll(c io.Reader, eof chan struct{}) <-chan got {
	recv := make(chan got, 1)
	go func() {
		h := sha256.New()
		n, err := io.Copy(h, c)
		if eof != nil {
			close(eof)
		}
		recv <- got{n, h.Sum(nil), err}
	}()
	return recv
}

// pacedDuplex is the duplex stream of the flip tests: it sends seed's
// bytes, 64 KiB every 10 ms, until end is closed, then half-closes and
// waits for recv (the other direction's read); it returns duplexLine.
func pacedDuplex(c *guestlib.Conn, tag string, port uint32, seed uint64, end <-chan struct{}, recv <-chan got, start time.Time) (string, error) {
	h := sha256.New()
	src := rand.NewChaCha8(seedBytes(seed))
	buf := make([]byte, 64<<10)
	var sent int64
	var werr error
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
send:
	for {
		select {
		case <-end:
			break send
		case <-tick.C:
		}
		src.Read(buf)
		k, err := c.Write(buf)
		h.Write(buf[:k])
		sent += int64(k)
		if err != nil {
			werr = err
			break
		}
	}
	return duplexLine(c, tag, port, sent, h.Sum(nil), werr, recv, start)
}

// duplexLine half-closes c after a writer that sent sent bytes (SHA-256
// sum; werr how its writes ended), waits for recv, and returns the line
// "SHUNT-VSOCK tag port=..." with both directions' length and SHA-256 and
// c's per-path counts.
func duplexLine(c *guestlib.Conn, tag string, port uint32, sent int64, sum []byte, werr error, recv <-chan got, start time.Time) (string, error) {
	if werr == nil {
		werr = c.CloseWrite()
	}
	r := <-recv
	if r.err != nil || werr != nil {
		return "", fmt.Errorf("read %d bytes: %v; wrote %d: %v; stats %+v", r.n, r.err, sent, werr, c.Stats())
	}
	st := c.Stats()
	return fmt.Sprintf("SHUNT-VSOCK %s port=%d sent=%x sentbytes=%d recv=%x bytes=%d ring=%d/%d tcp=%d/%d readies=%d downs=%d resent=%d ms=%d", tag, port, sum, sent, r.sum, r.n,
		st.RingSent, st.RingReceived, st.TCPSent, st.TCPReceived, st.Readies, st.Downs, st.Resent, time.Since(start).Milliseconds()), nil
}
