// Command shunt-rdma lists RDMA devices and exercises the relay's RDMA
// link between two hosts: seeded streams both ways over relay.RDMALink,
// checksummed, with the bandwidth (or over the TCP link, -tcp, for a side
// by side). The RDMA part needs a build with -tags rdma (relay/ibv);
// without it the command says so. docs/rdma.md shows its use.
//
//	shunt-rdma devices
//	shunt-rdma stream -listen :7471 [-bytes N] [-flows F] [-oneway] [-tcp]
//	shunt-rdma stream -connect HOST:7471 [...]
//	shunt-rdma fault (-listen :7474 | -connect HOST:7474) [-bytes N] [-at M]
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"time"

	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/relay/ibv"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: shunt-rdma devices | stream|fault (-listen ADDR | -connect ADDR) [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "devices":
		err = devices()
	case "stream":
		err = stream(os.Args[2:])
	case "fault":
		err = fault(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "shunt-rdma:", err)
		os.Exit(1)
	}
}

func devices() error {
	devs, err := relay.RDMADevices("")
	if err != nil {
		return err
	}
	if len(devs) == 0 {
		fmt.Println("no RDMA devices (/sys/class/infiniband): the relay uses the TCP link")
	}
	for _, d := range devs {
		for _, p := range d.Ports {
			fmt.Printf("%s port %d: %s, %s\n", d.Name, p.Num, p.State, p.LinkLayer)
			for _, g := range p.GIDs {
				fmt.Printf("  gid %d %s %s %s\n", g.Index, g.GID, g.Type, g.Netdev)
			}
		}
	}
	if d, p, g, ok := relay.PickRDMA(devs, ""); ok {
		fmt.Printf("link would use %s port %d gid %d\n", d, p, g)
	}
	return nil
}

// stream: each side opens -flows flows, sends -bytes seeded bytes on each
// (unless -oneway and it is the listener) and checks what it receives
// against the peer's seed.
func stream(args []string) error {
	fs := flag.NewFlagSet("stream", flag.ExitOnError)
	listen := fs.String("listen", "", "wait for the peer on this address (side channel)")
	connect := fs.String("connect", "", "the peer's side channel address")
	size := fs.Int("bytes", 64<<20, "bytes per flow and direction")
	flows := fs.Int("flows", 4, "flows")
	oneway := fs.Bool("oneway", false, "only the connecting side sends (a bandwidth figure beside ib_write_bw)")
	check := fs.Bool("check", true, "send seeded bytes and check them by SHA-256 (false: zeros, not checked, for bandwidth)")
	tcp := fs.Bool("tcp", false, "use the TCP link (relay.Link over 2 connections) instead of RDMA")
	device := fs.String("device", "", "RDMA device (default: the first active)")
	ring := fs.Int("ring", 4<<20, "ring bytes")
	depth := fs.Int("depth", 128, "batches in flight")
	timeout := fs.Duration("timeout", 5*time.Minute, "give up after")
	fs.Parse(args)
	if (*listen == "") == (*connect == "") {
		return fmt.Errorf("one of -listen and -connect")
	}
	server := *listen != ""
	nconn := 1
	if *tcp {
		nconn = 2
	}
	conns, err := sideConns(*listen, *connect, nconn, time.Minute)
	if err != nil {
		return err
	}
	var link relay.Carrier
	kind := "tcp"
	if *tcp {
		link = relay.NewLink(conns, relay.LinkOptions{})
	} else {
		kind = "rdma"
		l, _, err := rdmaLink(conns[0], *device, *ring, *depth)
		if err != nil {
			return err
		}
		link = l
	}
	defer link.Close()
	me, peer := uint64(1), uint64(2)
	if server {
		me, peer = 2, 1
	}
	send := !(*oneway && server)
	recv := !(*oneway && !server)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 2**flows)
	var mu sync.Mutex
	var got int64
	for id := range uint32(*flows) {
		f, err := link.Open(id)
		if err != nil {
			return err
		}
		if send {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := io.LimitReader(zeros{}, int64(*size))
				if *check {
					r = seededReader(me, id, *size)
				}
				buf := make([]byte, 256<<10)
				if _, err := io.CopyBuffer(f, r, buf); err != nil {
					errs <- fmt.Errorf("flow %d send: %w", id, err)
					return
				}
				f.Left()
				for f.Acked() < uint64(*size) && link.Err() == nil {
					time.Sleep(time.Millisecond)
				}
			}()
		}
		if recv {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if !*check {
					n, err := io.CopyBuffer(io.Discard, f, make([]byte, 256<<10))
					if err != nil || n != int64(*size) {
						errs <- fmt.Errorf("flow %d: received %d bytes (want %d), %v", id, n, *size, err)
						return
					}
					mu.Lock()
					got += n
					mu.Unlock()
					return
				}
				h := sha256.New()
				n, err := io.CopyBuffer(h, f, make([]byte, 256<<10))
				want := sha256.New()
				io.Copy(want, seededReader(peer, id, *size))
				if err != nil || n != int64(*size) || hex.EncodeToString(h.Sum(nil)) != hex.EncodeToString(want.Sum(nil)) {
					errs <- fmt.Errorf("flow %d: received %d bytes (want %d), %v, checksum match %v", id, n, *size, err,
						hex.EncodeToString(h.Sum(nil)) == hex.EncodeToString(want.Sum(nil)))
					return
				}
				mu.Lock()
				got += n
				mu.Unlock()
			}()
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(*timeout):
		return fmt.Errorf("%s stream: not done within %s (link %v, stats %+v)", kind, *timeout, link.Err(), link.Stats())
	}
	took := time.Since(start)
	close(errs)
	for err := range errs {
		return err
	}
	st := link.Stats()
	// The sender's figure counts from its start to its last byte
	// acknowledged; the receiver's to its last byte checked.
	moved := got
	if !recv {
		moved = int64(st.BytesOut)
	}
	fmt.Printf("SHUNT-RDMA %s OK flows=%d bytes=%d seconds=%.3f MBps=%.2f frames=%d writes=%d stalled=%s\n",
		kind, *flows, moved, took.Seconds(), float64(moved)/took.Seconds()/1e6, st.Frames, st.Writes, st.Stalled)
	// Let the last credits reach the peer before the link goes.
	time.Sleep(200 * time.Millisecond)
	return nil
}

// sideConns makes n TCP connections to the peer: accepted on listen, or
// dialled to connect (retrying for wait while the peer starts: under
// TCG on a loaded machine the peer may still be busy for long).
func sideConns(listen, connect string, n int, wait time.Duration) ([]net.Conn, error) {
	var conns []net.Conn
	if listen != "" {
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		for range n {
			c, err := ln.Accept()
			if err != nil {
				return nil, err
			}
			conns = append(conns, c)
		}
		return conns, nil
	}
	for range n {
		var c net.Conn
		var err error
		for end := time.Now().Add(wait); ; time.Sleep(100 * time.Millisecond) {
			if c, err = net.Dial("tcp", connect); err == nil || time.Now().After(end) {
				break
			}
		}
		if err != nil {
			return nil, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}

// rdmaLink sets up the RDMA link over side as the relay does
// (relay.NegotiateRDMA: the link watches side), and returns its queue
// pair too (for -fault). Both ends must offer RDMA here.
func rdmaLink(side net.Conn, device string, ring, depth int) (*relay.RDMALink, relay.Verbs, error) {
	var v relay.Verbs
	open := func() (relay.Verbs, error) {
		var err error
		v, err = ibv.Open(ibv.Config{Device: device, GIDIndex: -1, Size: ring, Depth: depth})
		return v, err
	}
	l, err := relay.NegotiateRDMA(side, open, relay.RDMAOptions{})
	if err != nil {
		return nil, nil, err
	}
	return l, v, nil
}

// seededReader is flow id's stream from side.
func seededReader(side uint64, id uint32, n int) io.Reader {
	return io.LimitReader(&rngReader{rand.NewPCG(side, uint64(id))}, int64(n))
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) { clear(b); return len(b), nil }

type rngReader struct{ p *rand.PCG }

func (r *rngReader) Read(b []byte) (int, error) {
	for i := 0; i < len(b); i += 8 {
		v := r.p.Uint64()
		for j := 0; j < 8 && i+j < len(b); j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return len(b), nil
}
