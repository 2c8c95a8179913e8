//go:build linux

package preload

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// pattern is a stream whose byte i is f(i), as an io.Reader from 0.
type pattern struct {
	f func(uint64) byte
	i uint64
}

func (p *pattern) Read(b []byte) (int, error) {
	for k := range b {
		b[k] = p.f(p.i)
		p.i++
	}
	return len(b), nil
}

// checker checks a stream against f, remembering the first wrong offset.
type checker struct {
	f   func(uint64) byte
	n   uint64
	bad int64
}

func (c *checker) Write(b []byte) (int, error) {
	for k, v := range b {
		if c.bad < 0 && v != c.f(c.n+uint64(k)) {
			c.bad = int64(c.n) + int64(k)
		}
	}
	c.n += uint64(len(b))
	return len(b), nil
}

// The patterns of guestlib/c/xtest/stretch.c.
func wbyte(i uint64) byte { return byte(i*131 + i>>9) }
func rbyte(i uint64) byte { return byte(i*17 + i>>11) }

// TestStretchC: the C core's vsock stretch (guestlib/c/stretch.c) through
// shunt-vstretchd's Serve, with a host behind it that bridges the stream
// to a ring pair of its own (hostd's room's part) over loopback: the C
// program (shunt-xtest stretch) attaches to the daemon's memfd rings for
// a READY of a region it has not mapped, writes 2 MiB while it reads
// 1 MiB, each checked byte for byte at the other end; DRAIN says its
// last bytes crossed, and BYE ends the host's bridge cleanly. A program
// that dies mid-stream (no BYE) breaks the host's bridge instead.
func TestStretchC(t *testing.T) {
	bin := xtest(t)
	for _, mode := range []string{"bye", "die"} {
		t.Run(mode, func(t *testing.T) {
			const capacity, wlen, rlen = 64 << 10, 2 << 20, 1 << 20
			procW, procR := shmtest.Ring(t, capacity), shmtest.Ring(t, capacity)
			bridge := make(chan *relay.Bridge, 1)
			dial := func() (net.Conn, error) {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					return nil, err
				}
				defer ln.Close()
				vm, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					return nil, err
				}
				hc, err := ln.Accept()
				if err != nil {
					vm.Close()
					return nil, err
				}
				go func() {
					if h, err := relay.ReadHello(hc); err != nil || h != (relay.Hello{Region: 5, Slot: 1, Gen: 9, Flags: relay.HelloHold}) {
						t.Errorf("hello %+v %v", h, err)
						hc.Close()
						return
					}
					l := relay.NewLink([]net.Conn{hc}, relay.LinkOptions{})
					f, err := l.Open(relay.VsockFlowID)
					if err != nil {
						l.Close()
						return
					}
					bridge <- relay.NewBridge(procW, procR, f, relay.BridgeOptions{Attached: f.Attached}) // as hostd's room
				}()
				return vm, nil
			}
			sock := filepath.Join(t.TempDir(), "vstretchd.sock")
			l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
			if err != nil {
				t.Fatal(err)
			}
			served := make(chan error, 1)
			go func() { served <- vstretch.Serve(l, vstretch.ServeOptions{Dial: dial}) }() // no t.Logf: its connections may log after the test
			defer func() {
				l.Close()
				if err := <-served; !errors.Is(err, net.ErrClosed) {
					t.Errorf("Serve: %v", err)
				}
			}()
			deadline := time.Now().Add(30 * time.Second)
			got := &checker{f: wbyte, bad: -1}
			read := make(chan error, 1)
			go func() { _, _, err := shmtest.ReadStream(procR, nil, got, deadline); read <- err }()
			go shmtest.WriteStream(procW, nil, 0, io.LimitReader(&pattern{f: rbyte}, rlen), deadline)
			cmd := exec.Command(bin, "stretch", fmt.Sprint(wlen), mode)
			cmd.Env = append(cmd.Environ(), "SHUNT_VSTRETCHD="+sock)
			out, err := cmd.CombinedOutput()
			var hb *relay.Bridge
			select {
			case hb = <-bridge:
			case <-time.After(time.Until(deadline)):
				t.Fatalf("no stretch reached the host: %v\n%s", err, out)
			}
			select {
			case <-hb.Done():
			case <-time.After(time.Until(deadline)):
				t.Fatalf("the host's bridge did not end: %+v\n%s", hb.Stats(), out)
			}
			if mode == "die" {
				if hb.Err() == nil || errors.Is(hb.Err(), relay.ErrEnded) {
					t.Fatalf("host bridge: %v, want a break\n%s", hb.Err(), out)
				}
				if got.bad >= 0 {
					t.Fatalf("the host read a wrong byte at %d\n%s", got.bad, out)
				}
				return
			}
			if err != nil || !strings.Contains(string(out), fmt.Sprintf("read %d ok\n", rlen)) || !strings.Contains(string(out), "drain 0\n") || !strings.Contains(string(out), "done\n") {
				t.Fatalf("shunt-xtest stretch: %v\n%s", err, out)
			}
			if err := <-read; err != nil || got.n != wlen || got.bad >= 0 {
				t.Fatalf("host read %d bytes (want %d), first wrong at %d, %v\n%s", got.n, wlen, got.bad, err, out)
			}
			if !errors.Is(hb.Err(), relay.ErrEnded) {
				t.Fatalf("host bridge: %v, want a clean end\n%s", hb.Err(), out)
			}
			t.Logf("%s", out)
		})
	}
}
