package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/shuntnet/shunt/relay"
)

// fault: one flow from the connecting side to the listener, over the RDMA
// link; after -at bytes the sender puts its queue pair in error (as a NIC
// or fabric fault would). Both links must end with an error, and the
// stream resumes on plain TCP (the side channel's port + 1) where the
// receiver's consumer stopped, which must lie between what the sender
// saw acknowledged and what it wrote: the receiver checks the whole
// stream by SHA-256, so no byte is lost or repeated across the fall back.
func fault(args []string) error {
	fs := flag.NewFlagSet("fault", flag.ExitOnError)
	listen := fs.String("listen", "", "wait for the peer on this address (side channel; port+1 for the resume)")
	connect := fs.String("connect", "", "the peer's side channel address")
	size := fs.Int("bytes", 32<<20, "the stream's bytes")
	at := fs.Int("at", 8<<20, "bytes written before the fault")
	device := fs.String("device", "", "RDMA device (default: the first active)")
	// Generous: under TCG on a loaded machine (load 11) every pass over
	// the bytes (seeding, SHA-256, rxe's CRC) slows several times; the
	// test's own deadline is the way out.
	timeout := fs.Duration("timeout", 5*time.Minute, "give up after")
	fs.Parse(args)
	if (*listen == "") == (*connect == "") || *at >= *size {
		return errors.New("one of -listen and -connect, and -at under -bytes")
	}
	addr := *listen + *connect
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	p, _ := strconv.Atoi(port)
	resume := net.JoinHostPort(host, strconv.Itoa(p+1))
	end := time.Now().Add(*timeout)
	conns, err := sideConns(*listen, *connect, 1, time.Until(end))
	if err != nil {
		return err
	}
	l, v, err := rdmaLink(conns[0], *device, 4<<20, 128)
	if err != nil {
		return err
	}
	defer l.Close()
	f, err := l.Open(1)
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	if *listen != "" {
		go func() { done <- faultReceive(f, l, resume, *size) }()
	} else {
		b, ok := v.(interface{ Break() error })
		if !ok {
			return errors.New("this verbs layer cannot break its queue pair")
		}
		go func() { done <- faultSend(f, l, b, resume, *size, *at, end) }()
	}
	select {
	case err := <-done:
		return err
	case <-time.After(time.Until(end)):
		return fmt.Errorf("fault: not done within %s (%v)", *timeout, l.Err())
	}
}

func faultSend(f *relay.Flow, l *relay.RDMALink, b interface{ Break() error }, resume string, size, at int, end time.Time) error {
	r := seededReader(1, 1, size)
	buf := make([]byte, 64<<10)
	written, broke := 0, false
	var werr error
	for written < size {
		n, _ := io.ReadFull(r, buf[:min(len(buf), size-written)])
		m, err := f.Write(buf[:n])
		written += m
		if err != nil {
			werr = err
			break
		}
		if written >= at && !broke {
			broke = true
			if err := b.Break(); err != nil {
				return fmt.Errorf("break the queue pair: %w", err)
			}
		}
	}
	if werr == nil {
		// Everything was queued before the link noticed: wait for it.
		for l.Err() == nil {
			time.Sleep(time.Millisecond)
		}
	}
	acked := f.Acked()
	// The receiver listens once its link ended and it took what came
	// before: keep dialling until the deadline, not a fixed while (a
	// 30 s retry ran out under load, leaving the receiver to wait).
	c, err := sideConns("", resume, 1, time.Until(end))
	if err != nil {
		return err
	}
	defer c[0].Close()
	var ob [8]byte
	if _, err := io.ReadFull(c[0], ob[:]); err != nil {
		return fmt.Errorf("the receiver's offset: %w", err)
	}
	off := binary.LittleEndian.Uint64(ob[:])
	if off < acked || off > uint64(written) {
		return fmt.Errorf("the receiver took %d, but %d were acknowledged and %d written", off, acked, written)
	}
	r = seededReader(1, 1, size)
	io.CopyN(io.Discard, r, int64(off))
	if _, err := io.Copy(c[0], r); err != nil {
		return err
	}
	fmt.Printf("SHUNT-RDMA fault OK sender: broke at %d, wrote %d, acked %d, resumed on TCP at %d; link: %v\n", at, written, acked, off, l.Err())
	return nil
}

func faultReceive(f *relay.Flow, l *relay.RDMALink, resume string, size int) error {
	// The expected sum, meanwhile (a pass over the stream costs seconds
	// under TCG).
	wantSum := make(chan []byte, 1)
	go func() {
		want := sha256.New()
		io.Copy(want, seededReader(1, 1, size))
		wantSum <- want.Sum(nil)
	}()
	h := sha256.New()
	took, err := io.Copy(h, f)
	if err == nil {
		return fmt.Errorf("the whole stream (%d bytes) crossed before the fault", took)
	}
	c, err := sideConns(resume, "", 1, 0)
	if err != nil {
		return err
	}
	defer c[0].Close()
	var ob [8]byte
	binary.LittleEndian.PutUint64(ob[:], uint64(took))
	if _, err := c[0].Write(ob[:]); err != nil {
		return err
	}
	rest, err := io.Copy(h, c[0])
	if err != nil {
		return err
	}
	want := <-wantSum
	if took+rest != int64(size) || !bytes.Equal(h.Sum(nil), want) {
		return fmt.Errorf("received %d on RDMA and %d on TCP of %d; checksum match %v", took, rest, size, bytes.Equal(h.Sum(nil), want))
	}
	fmt.Printf("SHUNT-RDMA fault OK receiver: %d bytes on RDMA, %d on TCP, checksum matches; link: %v\n", took, rest, l.Err())
	return nil
}
