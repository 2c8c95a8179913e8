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

// target is the address gdial connects to (phase target).
var target string

// gdial is the VM's end of TestVsockProcessGuest: a guestlib connection
// to target:port, which must reach the fast path (over vsock: this VM has
// no ivshmem), then n seeded bytes each way at once, half-closes, and the
// SHA-256 of both directions.
func gdial(port uint32, n int64, seed uint64) error {
	cl, err := guestlib.NewClient(guestlib.Options{Vsock: true, Logf: func(f string, a ...any) { fmt.Printf("SHUNT-VSOCK LOG "+f+"\n", a...) }})
	if err != nil {
		return err
	}
	d := guestlib.Dialer{Client: cl}
	c, err := d.Dial("tcp", fmt.Sprintf("%s:%d", target, port))
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
	start := time.Now()
	sent := make(chan []byte, 1)
	go func() {
		h := sha256.New()
		_, err := io.Copy(io.MultiWriter(c, h), io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n))
		if err != nil {
			fmt.Printf("SHUNT-VSOCK ERROR write: %v\n", err)
		}
		c.CloseWrite()
		sent <- h.Sum(nil)
	}()
	h := sha256.New()
	got, err := io.Copy(h, c)
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", got, err)
	}
	fmt.Printf("SHUNT-VSOCK gdial port=%d sent=%x recv=%x bytes=%d path=%v ms=%d stats=%+v\n", port, <-sent, h.Sum(nil), got, c.Path(), time.Since(start).Milliseconds(), c.Stats())
	return nil
}
