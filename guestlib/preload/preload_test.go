package preload

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/proto/prototest"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// xtest builds the C test tool against the core with the Makefile's flags
// (its shunt-xtest target, part of make ctest).
func xtest(t *testing.T) string {
	t.Helper()
	testenv.NeedTool(t, "make", "make")
	testenv.NeedTool(t, "gcc", "gcc")
	bin := filepath.Join(t.TempDir(), "shunt-xtest")
	cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+filepath.Dir(bin), bin)
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the C test tool: %v\n%s", err, out)
	}
	return bin
}

func addrText(a netip.AddrPort) string {
	b := a.Addr().As16()
	if !a.Addr().IsValid() {
		b = [16]byte{}
	}
	return hex.EncodeToString(b[:]) + ":" + strconv.Itoa(int(a.Port()))
}

// fields renders a message the way xtest prints it.
func fields(m proto.Msg) string {
	return fmt.Sprintf("type=%d req=%d role=%d side=%d reason=%d slot=%d gen=%d cap=%d ab=%d ba=%d rid=%d guest=%d rsize=%d pid=%d nonce=%d formats=%d offset=%d region=%s text=%s local=%s remote=%s",
		m.Type, m.ReqID, m.Role, m.Side, m.Reason, m.Slot, m.Gen, m.Capacity, m.RingAB, m.RingBA, m.RegionID, m.GuestID,
		m.RegionSize, m.PID, m.Nonce, m.Formats, m.Offset, m.Region, m.Text, addrText(m.Local), addrText(m.Remote))
}

// TestProtocolVectors: every message type encoded by Go decodes in C to the
// same fields and re-encodes to the same bytes; frames Go calls malformed, C
// does too.
func TestProtocolVectors(t *testing.T) {
	bin := xtest(t)
	msgs := prototest.Samples()
	var in strings.Builder
	var frames [][]byte
	for _, m := range msgs {
		f, err := m.Append(nil)
		if err != nil {
			t.Fatal(err)
		}
		frames = append(frames, f)
	}
	// Malformed frames: both sides must refuse them.
	good := frames[5]
	bad := [][]byte{
		append([]byte{1}, good[1:]...),            // version 1
		append([]byte{2, 200}, good[2:]...),       // type
		good[:len(good)-1],                        // truncated
		append(append([]byte{}, good[:12]...), 3), // bad role, short
		append(append([]byte{}, good...), 0),      // trailing byte
	}
	for _, f := range append(frames, bad...) {
		in.WriteString(hex.EncodeToString(f) + "\n")
	}
	cmd := exec.Command(bin, "vectors")
	cmd.Stdin = strings.NewReader(in.String())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("xtest vectors: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(frames)+len(bad) {
		t.Fatalf("xtest answered %d lines for %d frames", len(lines), len(frames)+len(bad))
	}
	for i, m := range msgs {
		parts := strings.SplitN(lines[i], " ", 3)
		if parts[0] != "OK" {
			t.Errorf("%s: C refused a frame Go encoded", m.Type)
			continue
		}
		if parts[1] != hex.EncodeToString(frames[i]) {
			t.Errorf("%s: C re-encoded\n %s\nGo encoded\n %s", m.Type, parts[1], hex.EncodeToString(frames[i]))
		}
		if parts[2] != fields(m) {
			t.Errorf("%s: C decoded\n %s\nwant\n %s", m.Type, parts[2], fields(m))
		}
	}
	for i := range bad {
		if _, err := proto.Decode(bad[i]); err == nil {
			t.Errorf("bad frame %d: Go accepted it", i)
		}
		if got := lines[len(frames)+i]; got != "ERR" {
			t.Errorf("bad frame %d: C answered %q, want ERR", i, got)
		}
	}
}

// TestReasonNames: C names every reason as Go does (the -v lines and the
// docs use the names).
func TestReasonNames(t *testing.T) {
	out, err := exec.Command(xtest(t), "reasons").Output()
	if err != nil {
		t.Fatalf("xtest reasons: %v", err)
	}
	var want []string
	for _, r := range proto.Reasons() {
		want = append(want, r.String())
	}
	if got := strings.Fields(string(out)); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("C reason names:\n %v\nGo:\n %v", got, want)
	}
}

// flow makes a region file with one flow and returns its path and entry.
func flow(t *testing.T, capacity int) (string, int, region.Entry, *region.Region) {
	path := filepath.Join(t.TempDir(), "region")
	r, err := region.Create(path, region.Geometry{Size: 16 << 20, Slots: 8}, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	pool := region.NewPool(r, nil)
	pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: 4096}) // so the flow is not at slot 0
	slot, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	return path, slot, e, r
}

// TestGoWritesCReads: 64 MiB from a Go writer to a C reader in another
// process through one ring, random chunk sizes on both sides.
func TestGoWritesCReads(t *testing.T) {
	bin := xtest(t)
	path, slot, e, r := flow(t, 256<<10)
	ab, _, err := r.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	w, _ := ring.NewWriter(ab, &wait.Policy{})
	cmd := exec.Command(bin, "ring-read", path, strconv.Itoa(slot), strconv.FormatUint(e.Gen, 10), "2")
	cmd.Stderr = os.Stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	const total = 64 << 20
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<20)
	var sum uint32
	for left := total; left > 0; {
		k := min(left, 1+rng.IntN(len(buf)))
		for i := range buf[:k] {
			buf[i] = byte(rng.Uint32())
		}
		sum = crc32.Update(sum, crc32.IEEETable, buf[:k])
		if _, err := w.Write(buf[:k]); err != nil {
			t.Fatal(err)
		}
		left -= k
	}
	w.CloseWrite()
	line, _ := bufio.NewReader(out).ReadString('\n')
	cmd.Wait()
	if want := fmt.Sprintf("bytes %d crc %d\n", total, sum); line != want {
		t.Fatalf("C reader: %q, want %q", line, want)
	}
}

// TestCWritesGoReads: the other direction, C writer on ring BA (side B).
func TestCWritesGoReads(t *testing.T) {
	bin := xtest(t)
	path, slot, e, r := flow(t, 64<<10)
	_, ba, err := r.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	rd, _ := ring.NewReader(ba, &wait.Policy{})
	const total = 64 << 20
	cmd := exec.Command(bin, "ring-write", path, strconv.Itoa(slot), strconv.FormatUint(e.Gen, 10), "2", strconv.Itoa(total), "12345")
	cmd.Stderr = os.Stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := crc32.NewIEEE()
	n, err := io.Copy(h, rd)
	if err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	cmd.Wait()
	if want := fmt.Sprintf("crc %d\n", h.Sum32()); n != total || line != want {
		t.Fatalf("Go read %d bytes with %q; C wrote %d with %q", n, want, total, line)
	}
}
