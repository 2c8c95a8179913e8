//go:build linux

package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// BenchmarkVsockVMToVM's two ends: bserve in VM B, bclient in VM A. Each
// connection opens with an op byte and a count: 'p' n: n ping-pongs of 8
// bytes (the client writes, the server echoes); 's' n: the client streams
// n bytes in 64 KiB writes and half-closes, the server reads to EOF and
// answers one byte.

// bserve serves rounds of bclient's connections, in bclient's order:
// two on port with guestlib (over vsock, the fast path), then two on
// port+1 with the kernel's TCP alone (virtio-net).
func bserve(port uint32, rounds int64) error {
	cl, err := guestlib.NewClient(guestlib.Options{Vsock: true})
	if err != nil {
		return err
	}
	lc := guestlib.ListenConfig{Client: cl}
	ls, err := lc.Listen(context.Background(), "tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		return err
	}
	defer ls.Close()
	lt, err := net.Listen("tcp", fmt.Sprintf(":%d", port+1))
	if err != nil {
		return err
	}
	defer lt.Close()
	fmt.Printf("SHUNT-VSOCK LISTENING port=%d\n", port)
	for range rounds {
		for _, l := range []net.Listener{ls, ls, lt, lt} {
			c, err := l.Accept()
			if err != nil {
				return err
			}
			if err := serveOne(c); err != nil {
				return err
			}
		}
	}
	return nil
}

func serveOne(c net.Conn) error {
	defer c.Close()
	var h [9]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return err
	}
	n := binary.LittleEndian.Uint64(h[1:])
	switch h[0] {
	case 'p':
		msg := make([]byte, 8)
		for i := uint64(0); i < n; i++ {
			if _, err := io.ReadFull(c, msg); err != nil {
				return fmt.Errorf("pong %d: %w", i, err)
			}
			if _, err := c.Write(msg); err != nil {
				return err
			}
		}
	case 's':
		k, err := io.Copy(io.Discard, c)
		if err != nil || uint64(k) != n {
			return fmt.Errorf("stream: %d of %d bytes: %v", k, n, err)
		}
		if _, err := c.Write([]byte{1}); err != nil {
			return err
		}
	}
	return nil
}

// bclient runs rounds interleaved rounds against target (VM B): each
// round Shunt (guestlib over vsock, waited onto the fast path) then the
// kernel's TCP over virtio-net, each a setup (dial, and for Shunt the
// switch to the rings), pongs 8 B ping-pongs and a stream of n bytes.
func bclient(port uint32, rounds int64, n int64) error {
	const pongs = 2000
	cl, err := guestlib.NewClient(guestlib.Options{Vsock: true})
	if err != nil {
		return err
	}
	d := guestlib.Dialer{Client: cl}
	dial := func(shunt bool) (net.Conn, error) {
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			var c net.Conn
			var err error
			if shunt {
				var sc *guestlib.Conn
				if sc, err = d.Dial("tcp", net.JoinHostPort(target, strconv.Itoa(int(port)))); err == nil {
					for !sc.Path().Fast {
						if time.Now().After(deadline) {
							sc.Close()
							return nil, fmt.Errorf("not on the fast path after 60 s: %v", sc.Path())
						}
						time.Sleep(200 * time.Microsecond)
					}
					c = sc
				}
			} else {
				c, err = net.Dial("tcp", net.JoinHostPort(target, strconv.Itoa(int(port+1))))
			}
			if err == nil || time.Now().After(deadline) {
				return c, err
			}
		}
	}
	hdr := func(op byte, n uint64) []byte {
		h := make([]byte, 9)
		h[0] = op
		binary.LittleEndian.PutUint64(h[1:], n)
		return h
	}
	for r := range rounds {
		for _, shunt := range []bool{true, false} {
			mode := "tcp"
			if shunt {
				mode = "shunt"
			}
			t0 := time.Now()
			c, err := dial(shunt)
			if err != nil {
				return err
			}
			setup := time.Since(t0)
			if _, err := c.Write(hdr('p', pongs)); err != nil {
				return err
			}
			msg := make([]byte, 8)
			t1 := time.Now()
			for i := 0; i < pongs; i++ {
				if _, err := c.Write(msg); err != nil {
					return err
				}
				if _, err := io.ReadFull(c, msg); err != nil {
					return err
				}
			}
			oneway := time.Since(t1) / (2 * pongs)
			c.Close()
			if c, err = dial(shunt); err != nil {
				return err
			}
			buf := make([]byte, 64<<10)
			t2 := time.Now()
			if _, err := c.Write(hdr('s', uint64(n))); err != nil {
				return err
			}
			for left := n; left > 0; {
				k, err := c.Write(buf[:min(int64(len(buf)), left)])
				if err != nil {
					return err
				}
				left -= int64(k)
			}
			if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
				return err
			}
			if _, err := io.ReadFull(c, msg[:1]); err != nil {
				return err
			}
			secs := time.Since(t2).Seconds()
			path := ""
			if sc, ok := c.(*guestlib.Conn); ok {
				st := sc.Stats()
				path = fmt.Sprintf(" ring=%d tcp=%d", st.RingSent, st.TCPSent)
			}
			c.Close()
			fmt.Printf("SHUNT-VSOCK BENCH round=%d mode=%s setup_us=%d oneway_us=%.1f mbps=%.1f%s\n", r, mode, setup.Microseconds(),
				float64(oneway.Nanoseconds())/1e3, float64(n)/secs/1e6, path)
		}
	}
	fmt.Printf("SHUNT-VSOCK BENCH done\n")
	return nil
}
