//go:build linux

package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// glisten is the accepting VM's end of TestVsockVMToVM: a guestlib
// listener on port (this VM has no ivshmem: its flows go over vsock); the
// one connection it accepts must reach the fast path. It then waits for
// the host's go (a plain TCP connection to port+1: the test saw the
// connection on the rings in `hostd flows`; until then the connection
// stays open). With n > 0 it then sends n seeded bytes while reading to
// EOF, as gdial. With n == 0 (TestVsockVMToVMFlips) it sends seeded
// bytes, 64 KiB every 10 ms, until the host connects to port+1 again
// (its flips are done), then half-closes and reads to EOF. With n < 0 it
// only reads, to EOF or an error, which its line gives. The line gives both
// directions' length and SHA-256 and the connection's per-path counts.
func glisten(port uint32, n int64, seed uint64) error {
	cl, err := guestlib.NewClient(guestlib.Options{Vsock: true, Logf: func(f string, a ...any) { fmt.Printf("SHUNT-VSOCK LOG "+f+"\n", a...) }})
	if err != nil {
		return err
	}
	lc := guestlib.ListenConfig{Client: cl}
	l, err := lc.Listen(context.Background(), "tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		return err
	}
	defer l.Close()
	endl, err := net.Listen("tcp", fmt.Sprintf(":%d", port+1))
	if err != nil {
		return err
	}
	defer endl.Close()
	fmt.Printf("SHUNT-VSOCK LISTENING port=%d\n", port)
	c, err := l.AcceptShunt()
	if err != nil {
		return err
	}
	defer c.Close()
	for deadline := time.Now().Add(60 * time.Second); !c.Path().Fast; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("not on the fast path after 60 s: %v", c.Path())
		}
	}
	fmt.Printf("SHUNT-VSOCK ONRINGS port=%d\n", port)
	hostWord := func() error {
		e, err := endl.Accept()
		if err == nil {
			e.Close()
		}
		return err
	}
	if err := hostWord(); err != nil {
		return err
	}
	start := time.Now()
	recv := readAll(c, nil)
	if n < 0 {
		// TestVsockVMToVMKilled: only read, to the stream's end or error.
		r := <-recv
		fmt.Printf("SHUNT-VSOCK glisten port=%d recv=%x bytes=%d reset=%v err=%v\n", port, r.sum, r.n, errors.Is(r.err, syscall.ECONNRESET), r.err)
		return nil
	}
	var line string
	if n > 0 {
		h := sha256.New()
		sent, werr := io.Copy(io.MultiWriter(c, h), io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n))
		line, err = duplexLine(c, "glisten", port, sent, h.Sum(nil), werr, recv, start)
	} else {
		end := make(chan struct{})
		go func() {
			_ = hostWord()
			close(end)
		}()
		line, err = pacedDuplex(c, "glisten", port, seed, end, recv, start)
	}
	if err != nil {
		return err
	}
	fmt.Println(line)
	return nil
}
