package preload

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/shm/ring"
)

// TestRecords runs each case of the core's record tests (shunt-xtest
// records NAME, guestlib/c/xtest/records.c): records in a ring, in place,
// over plain memory, without root or hostd.
func TestRecords(t *testing.T) {
	bin := xtest(t)
	for _, c := range []string{"stream", "stale", "corrupt", "drain", "half", "stride"} {
		t.Run(c, func(t *testing.T) {
			out, err := exec.Command(bin, "records", c).CombinedOutput()
			if err != nil {
				t.Fatalf("shunt-xtest records %s: %v\n%s", c, err, out)
			}
			t.Logf("%s", out)
		})
	}
}

// TestRecordsGoAndC: one format, two languages. A Go writer sends records
// of seeded random sizes (0 B to 16 KiB, some with a pad of the caller's
// choosing) through ring AB of a region to a C echo in another process
// (shunt-xtest records echo), which writes each back through ring BA to a
// Go reader: C reads what Go wrote and Go reads what C wrote, through
// wraps and PADs on both rings, and every record comes back in order with
// its tag and bytes.
func TestRecordsGoAndC(t *testing.T) {
	bin := xtest(t)
	n := 50000
	if testing.Short() {
		n = 5000
	}
	path, slot, e, reg := flow(t, 64<<10)
	ab, ba, err := reg.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	epoch := ring.NewRecEpoch()
	w, err := ring.NewRecWriter(ab, epoch)
	if err != nil {
		t.Fatal(err)
	}
	rd, err := ring.NewRecReader(ba, epoch)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(bin, "records", "echo")
	cmd.Env = append(os.Environ(), fmt.Sprintf("SHUNT_REC_SLOT=%d", slot), fmt.Sprintf("SHUNT_REC_GEN=%d", e.Gen),
		"SHUNT_REC_SIDE=2", "SHUNT_REC_EPOCH="+strconv.FormatUint(epoch, 10))
	cmd.ExtraFiles = []*os.File{f}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	defer func() {
		if !waited { // a failure left the echo running: stop it
			ab.Reset(1)
			cmd.Wait()
		}
	}()

	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	size := func(rng *rand.Rand) int {
		if rng.IntN(4) > 0 {
			return rng.IntN(200)
		}
		return rng.IntN(16 << 10)
	}
	pat := func(k, i int) byte { return byte(k*131 + i*7 + i>>8) }
	deadline := time.Now().Add(time.Minute)
	sent := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(seed, 1))
		for k := 0; k < n; k++ {
			m := size(rng)
			pad := ring.RecPadding(0, m)
			if k%5 == 0 {
				pad = k % 64
			}
			p, err := w.ReservePadded(pad, m)
			for errors.Is(err, ring.ErrRingFull) {
				if err = w.Wait(deadline); err == nil {
					p, err = w.ReservePadded(pad, m)
				}
			}
			if err != nil {
				sent <- fmt.Errorf("record %d: %w", k, err)
				return
			}
			for i := range p {
				p[i] = pat(k, i)
			}
			if err := w.Commit(m, ring.RecKindData, uint8(k)); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	rng := rand.New(rand.NewPCG(seed, 1))
	for k := 0; k < n; k++ {
		want := size(rng)
		rec, ok, err := rd.Poll()
		for !ok && err == nil {
			if err = rd.Wait(deadline); err == nil {
				rec, ok, err = rd.Poll()
			}
		}
		if err != nil {
			t.Fatalf("record %d: %v (echo: %s)", k, err, out.String())
		}
		if len(rec.Payload) != want || rec.Tag != uint8(k) {
			t.Fatalf("record %d: %d bytes, tag %d; want %d, %d", k, len(rec.Payload), rec.Tag, want, uint8(k))
		}
		for i, b := range rec.Payload {
			if b != pat(k, i) {
				t.Fatalf("record %d byte %d = %d, want %d", k, i, b, pat(k, i))
			}
		}
		rd.Consume()
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	ab.Reset(1)
	waited = true
	if err := cmd.Wait(); err != nil || out.String() != fmt.Sprintf("echo %d records\n", n) {
		t.Fatalf("echo: %v, %q; want %d records", err, out.String(), n)
	}
	// Every record was read at both ends (above, and the echo's count).
	// The ring's counters are no check of that: a reader publishes its
	// head lazily (records rings publish once per eighth of the ring),
	// so Read may trail (CI: AB 320 bytes and 2 publications short once,
	// after the echo had counted every record).
	sa, sb := ab.Stats(), ba.Stats()
	if sa.MsgsWritten <= uint64(n) || sb.MsgsWritten <= uint64(n) {
		t.Fatalf("AB %+v, BA %+v: want PADs on both (more publications than %d records)", sa, sb, n)
	}
}
