//go:build linux

package vsock_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/vhost/vsock"
)

const (
	guestCID  = 7
	streamLen = 4 << 20
	// Ports: the guest connects to the device's Go listener on portGo,
	// to the hybrid face's PATH_portHybrid, and listens on portGuest for
	// the host's CONNECT through the hybrid socket.
	portGo     = 5001
	portHybrid = 5002
	portGuest  = 5003
	// portParallel takes four guest connections at once, of parallelLen
	// bytes each way.
	portParallel = 5004
	parallelLen  = 1 << 20
)

// TestVhostUserVsock boots a TCG guest whose only Shunt device is
// vhost-user-vsock-pci (no ivshmem), served by vhost/vsock on a Unix
// socket, and streams 4 MiB of seeded bytes each way, with a half-close
// each way, three times, then four connections at once of 1 MiB: the
// guest connecting to a Go Listener (CID 2),
// the guest connecting through the hybrid face to a Unix socket at
// PATH_<port>, and the host connecting to the guest's listener through the
// hybrid socket (CONNECT <port>, OK <port>). Both ends' SHA-256 of each
// direction must match.
func TestVhostUserVsock(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	r := boot(t, ctx, "",
		fmt.Sprintf("connect:%d:%d:1", portGo, streamLen),
		fmt.Sprintf("connect:%d:%d:2", portHybrid, streamLen),
		fmt.Sprintf("listen:%d:%d:3", portGuest, streamLen),
		fmt.Sprintf("parallel:%d:%d:10", portParallel, parallelLen))
	booted := time.Since(start)
	ctx = r.ctx
	hyb, err := vsockServeHybrid(r)
	if err != nil {
		t.Fatal(err)
	}
	defer hyb.Close()
	goL, err := r.dev.Listen(portGo)
	if err != nil {
		t.Fatal(err)
	}
	defer goL.Close()
	hybL, err := net.Listen("unix", filepath.Join(r.dir, fmt.Sprintf("hv.sock_%d", portHybrid)))
	if err != nil {
		t.Fatal(err)
	}
	defer hybL.Close()

	// 1. The guest connects to the Go listener on CID 2.
	c, err := goL.AcceptContext(ctx)
	if err != nil {
		t.Fatalf("accept on 2:%d: %v\n%s", portGo, err, r.state())
	}
	r.guestLine(ctx, "guest to Go listener", exchange(ctx, c, 101, streamLen), "connect", portGo)

	// 2. The guest connects to PATH_<port> through the hybrid face.
	hc := make(chan net.Conn, 1)
	go func() {
		if c, err := hybL.Accept(); err == nil {
			hc <- c
		}
	}()
	var u net.Conn
	select {
	case u = <-hc:
	case <-ctx.Done():
		t.Fatalf("no hybrid connection on PATH_%d\n%s", portHybrid, r.state())
	}
	r.guestLine(ctx, "guest to hybrid PATH_port", exchange(ctx, u, 102, streamLen), "connect", portHybrid)

	// 3. The host connects to the guest's listener: CONNECT through the
	// hybrid socket.
	if _, err := r.v.Wait(ctx, fmt.Sprintf("SHUNT-VSOCK LISTENING port=%d", portGuest)); err != nil {
		t.Fatalf("%v\n%s", err, r.state())
	}
	hu, err := net.Dial("unix", filepath.Join(r.dir, "hv.sock"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(hu, "CONNECT %d\n", portGuest)
	_ = hu.SetReadDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(hu)
	ok, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(ok, "OK ") {
		t.Fatalf("CONNECT %d: %q %v\n%s", portGuest, ok, err, r.state())
	}
	_ = hu.SetReadDeadline(time.Time{})
	r.guestLine(ctx, "host to guest listener via hybrid CONNECT", exchange(ctx, readConn{hu, br}, 103, streamLen), "listen", portGuest)

	// 4. Four guest connections at once: each stream whole, none starved.
	pl, err := r.dev.Listen(portParallel)
	if err != nil {
		t.Fatal(err)
	}
	defer pl.Close()
	results := make(chan result, 4)
	for i := 0; i < 4; i++ {
		c, err := pl.AcceptContext(ctx)
		if err != nil {
			t.Fatalf("parallel accept %d: %v\n%s", i, err, r.state())
		}
		go func() {
			res := exchange(ctx, c, uint64(200+i), parallelLen)
			res.lport = c.RemoteAddr().(*vsock.Addr).Port
			results <- res
		}()
	}
	for i := 0; i < 4; i++ {
		res := <-results
		r.guestLineOf(ctx, "parallel", res, fmt.Sprintf("SHUNT-VSOCK connect port=%d lport=%d ", portParallel, res.lport))
	}

	if _, err := r.v.Wait(ctx, "SHUNT-VM AGENT-EXIT 0"); err != nil {
		t.Fatalf("%v\n%s", err, r.state())
	}
	t.Logf("boot %v, whole test %v", booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	s := r.dev.Stats()
	if n := s.BadPackets.Load() + s.QueueBroken.Load() + s.Resets.Load(); n != 0 {
		t.Fatalf("the honest guest's driver was refused %d times\n%s", n, r.state())
	}
}

// readConn reads through the bufio.Reader that read the OK line.
type readConn struct {
	net.Conn
	r *bufio.Reader
}

func (c readConn) Read(p []byte) (int, error) { return c.r.Read(p) }
func (c readConn) CloseWrite() error          { return c.Conn.(*net.UnixConn).CloseWrite() }

type result struct {
	sent, recv []byte
	n, want    int64
	lport      uint32 // the guest's port
	err        error
}

// exchange sends n seeded bytes (then half-closes) while reading to EOF,
// and closes c.
func exchange(ctx context.Context, c net.Conn, seed uint64, n int64) result {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	sent := make(chan result, 1)
	go func() {
		h := sha256.New()
		var b [32]byte
		for i := range b {
			b[i] = byte(seed >> (8 * (i % 8)))
		}
		_, err := io.Copy(io.MultiWriter(c, h), io.LimitReader(rand.NewChaCha8(b), n))
		if err == nil {
			err = c.(interface{ CloseWrite() error }).CloseWrite()
		}
		sent <- result{sent: h.Sum(nil), err: err}
	}()
	h := sha256.New()
	got, err := io.Copy(h, c)
	s := <-sent
	if err == nil {
		err = s.err
	}
	return result{sent: s.sent, recv: h.Sum(nil), n: got, want: n, err: err}
}
