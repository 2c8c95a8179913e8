//go:build linux

package main

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// stretchCapacity is each ring's capacity in the VM (as hostd's rings).
const stretchCapacity = 256 << 10

// stretch is the VM's end of TestVsockStretch: a guest library's writer
// and reader on the rings of a vsock stretch (see the package comment).
func stretch(flow string, n int64, seed uint64) error {
	var h relay.Hello
	ids := strings.Split(flow, ".")
	if len(ids) != 3 {
		return fmt.Errorf("flow %q: want REGION.SLOT.GEN", flow)
	}
	var v [3]uint64
	for i := range v {
		var err error
		if v[i], err = strconv.ParseUint(ids[i], 10, 64); err != nil {
			return err
		}
	}
	h.Region, h.Slot, h.Gen = uint32(v[0]), uint32(v[1]), v[2]
	var s *vstretch.Stretch
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		c, err := vstretch.Dial(relay.VsockPort)
		if err == nil {
			if s, err = vstretch.Open(c, h, stretchCapacity, nil); err != nil {
				return err
			}
			break
		}
		if time.Now().After(deadline) {
			return err
		}
	}
	defer s.Close()
	start := time.Now()
	deadline := start.Add(90 * time.Second)
	got := shmtest.ReadSum(s.R, nil, deadline)
	hs := sha256.New()
	src := io.TeeReader(io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n), hs)
	if _, err := shmtest.WriteStream(s.W, nil, seed*1000, src, deadline); err != nil {
		return fmt.Errorf("write ring: %w (bridge %v %+v)", err, s.Err(), s.Stats())
	}
	r := <-got
	if r.Err != nil {
		return fmt.Errorf("read ring after %d bytes: %w (bridge %v %+v)", r.N, r.Err, s.Err(), s.Stats())
	}
	select {
	case <-s.Done():
	case <-time.After(time.Until(deadline)):
		return fmt.Errorf("bridge did not end: %+v", s.Stats())
	}
	fmt.Printf("SHUNT-VSOCK stretch flow=%s start=%d sent=%x recv=%x bytes=%d end=%v ms=%d\n", flow, r.Start, hs.Sum(nil), r.Sum, r.N, s.Err(), time.Since(start).Milliseconds())
	return nil
}
