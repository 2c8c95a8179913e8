package shm_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// BenchmarkRecordPingPong: 8-byte records (shm/ring's records, C's
// records.c: one cache line per message) there and back between two
// processes through a ring pair that region.Pool allocated; the figure is
// half the round trip, as BenchmarkAtomicPingPong's, whose one line per
// one-way trip is the floor. go: Go at both ends (the echo is this binary
// again); go-c: Go pings a C echo (shunt-xtest records echo); c: C at both
// ends, timed by the C ping's own clock (ns/op there includes starting
// both processes). The C variants use $SHUNT_XTEST (make bench-shm
// builds it), else build shunt-xtest with make.
func BenchmarkRecordPingPong(b *testing.B) {
	b.Run("go/8B", func(b *testing.B) { goPing(b, startGoEcho(b)) })
	bin := os.Getenv("SHUNT_XTEST")
	if bin == "" {
		testenv.NeedTool(b, "make", "make")
		testenv.NeedTool(b, "gcc", "gcc")
		bin = filepath.Join(b.TempDir(), "shunt-xtest")
		cmd := exec.Command("make", "-s", "-C", "..", "BIN="+filepath.Dir(bin), bin)
		cmd.Env = append(os.Environ(), "MAKEFLAGS=")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("build shunt-xtest: %v\n%s", err, out)
		}
	}
	b.Run("go-c/8B", func(b *testing.B) { goPing(b, startCEcho(b, bin)) })
	b.Run("c/8B", func(b *testing.B) { cPing(b, bin) })
}

// recFlow is a ring pair in a fresh memfd region, shared with the echo
// process (fd 3) and, for c, the ping process.
type recFlow struct {
	f      *os.File
	slot   int
	gen    uint64
	epoch  uint64
	ab, ba *ring.Ring
	echo   *exec.Cmd
	out    strings.Builder
}

func newRecFlow(b *testing.B) *recFlow {
	const c = 64 << 10
	reg, f := shmtest.Region(b, region.Geometry{Size: 4*region.PairSize(c) + 64<<10, Slots: 4})
	slot, e, err := region.NewPool(reg, nil).Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: c})
	if err != nil {
		b.Fatal(err)
	}
	fl := &recFlow{f: f, slot: slot, gen: e.Gen, epoch: ring.NewRecEpoch()}
	if fl.ab, fl.ba, err = reg.Rings(slot, e.Gen); err != nil {
		b.Fatal(err)
	}
	return fl
}

// command runs name args as side (1: A, 2: B) of the flow.
func (fl *recFlow) command(side int, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), fmt.Sprintf("SHUNT_REC_SLOT=%d", fl.slot), fmt.Sprintf("SHUNT_REC_GEN=%d", fl.gen),
		fmt.Sprintf("SHUNT_REC_SIDE=%d", side), fmt.Sprintf("SHUNT_REC_EPOCH=%d", fl.epoch))
	cmd.ExtraFiles = []*os.File{fl.f}
	return cmd
}

// startEcho starts the echo as side B; a reset of ring AB stops it, which
// the cleanup does (and kills it if it does not stop).
func (fl *recFlow) startEcho(b *testing.B, cmd *exec.Cmd) *recFlow {
	cmd.Stdout, cmd.Stderr = &fl.out, &fl.out
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	fl.echo = cmd
	b.Cleanup(func() {
		fl.ab.Reset(1)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				b.Errorf("echo: %v\n%s", err, fl.out.String())
			}
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			b.Errorf("echo did not stop after the reset")
			<-done
		}
	})
	return fl
}

func startGoEcho(b *testing.B) *recFlow {
	fl := newRecFlow(b)
	cmd := fl.command(2, os.Args[0], "-test.run=^TestRecordEcho$")
	cmd.Env = append(cmd.Env, "SHUNT_REC_ECHO=1")
	return fl.startEcho(b, cmd)
}

func startCEcho(b *testing.B, bin string) *recFlow {
	fl := newRecFlow(b)
	return fl.startEcho(b, fl.command(2, bin, "records", "echo"))
}

// goPing is side A in this process: one untimed round trip while the echo
// starts, then b.Loop's.
func goPing(b *testing.B, fl *recFlow) {
	w, err := ring.NewRecWriter(fl.ab, fl.epoch)
	if err != nil {
		b.Fatal(err)
	}
	rd, err := ring.NewRecReader(fl.ba, fl.epoch)
	if err != nil {
		b.Fatal(err)
	}
	var i uint64
	roundTrip := func() {
		p, err := w.Reserve(8)
		if err != nil {
			b.Fatal(err)
		}
		binary.NativeEndian.PutUint64(p, i)
		w.Commit(8, ring.RecKindData, 0)
		rec, ok, err := rd.Poll()
		for !ok && err == nil {
			if err = rd.Wait(time.Time{}); err == nil {
				rec, ok, err = rd.Poll()
			}
		}
		if err != nil || len(rec.Payload) != 8 || binary.NativeEndian.Uint64(rec.Payload) != i {
			b.Fatalf("round trip %d: %v, %x", i, err, rec.Payload)
		}
		rd.Consume()
		i++
	}
	roundTrip()
	for b.Loop() {
		roundTrip()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/oneway")
}

// cPing runs b.N round trips between a C ping (side A) and a C echo.
func cPing(b *testing.B, bin string) {
	fl := startCEcho(b, bin)
	ping := fl.command(1, bin, "records", "ping")
	ping.Env = append(ping.Env, fmt.Sprintf("SHUNT_REC_COUNT=%d", b.N))
	ping.Stderr = os.Stderr
	out, err := ping.Output()
	var ns int64
	if _, serr := fmt.Sscanf(string(out), "ns %d", &ns); err != nil || serr != nil {
		b.Fatalf("C ping: %v, %q", err, out)
	}
	b.ReportMetric(float64(ns)/float64(b.N)/2, "ns/oneway")
}

// TestRecordEcho is no test: it is the Go echo process of
// BenchmarkRecordPingPong when SHUNT_REC_ECHO is set (os/exec's helper
// process pattern), side B of the flow on fd 3 that SHUNT_REC_* name.
func TestRecordEcho(t *testing.T) {
	if os.Getenv("SHUNT_REC_ECHO") == "" {
		return
	}
	if err := recEcho(); err != nil {
		fmt.Fprintf(os.Stderr, "Go echo: %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// recEcho writes every record of ring AB back on ring BA until AB is reset.
func recEcho() error {
	f := os.NewFile(3, "region")
	defer f.Close()
	reg, err := region.OpenFile(f)
	if err != nil {
		return err
	}
	env := func(name string) uint64 { v, _ := strconv.ParseUint(os.Getenv(name), 10, 64); return v }
	ab, ba, err := reg.Rings(int(env("SHUNT_REC_SLOT")), env("SHUNT_REC_GEN"))
	if err != nil {
		return err
	}
	rd, err := ring.NewRecReader(ab, env("SHUNT_REC_EPOCH"))
	if err != nil {
		return err
	}
	w, err := ring.NewRecWriter(ba, env("SHUNT_REC_EPOCH"))
	if err != nil {
		return err
	}
	for {
		rec, ok, err := rd.Poll()
		if errors.Is(err, ring.ErrReset) {
			return nil
		}
		if err != nil {
			return err
		}
		if !ok {
			rd.Wait(time.Time{})
			continue
		}
		p, err := w.Reserve(len(rec.Payload))
		for errors.Is(err, ring.ErrRingFull) {
			w.Wait(time.Time{})
			p, err = w.Reserve(len(rec.Payload))
		}
		if err != nil {
			return err
		}
		copy(p, rec.Payload)
		if err := w.Commit(len(p), ring.RecKindData, rec.Tag); err != nil {
			return err
		}
		if err := rd.Consume(); err != nil {
			return err
		}
	}
}
