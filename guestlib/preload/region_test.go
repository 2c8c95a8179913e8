package preload

import (
	"bufio"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"testing"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestCRegionByDescriptor: the C core, as a process guest, gets a region
// from a (fake) hostd as a descriptor (REGION over SCM_RIGHTS), attaches
// the flow a READY names in it, moves bytes both ways through its rings,
// names the region in CLOSE, and lets the region go on UNREGION.
func TestCRegionByDescriptor(t *testing.T) {
	bin := xtest(t)
	h := guesttest.Start(t)
	cmd := exec.Command(bin, "session", h.Control)
	cmd.Stderr = os.Stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	lines := bufio.NewReader(out)
	s := h.Accept(t)
	s.Expect(t, proto.Hello)
	s.WelcomeNoRegion(t)
	open := s.Expect(t, proto.Open)
	reg := h.NewRegion(t, 7)
	s.SendRegion(t, reg)
	f := h.PairIn(t, reg, open, proto.Msg{ReqID: 99})
	s.Send(t, f.A)
	// The test is side B: it writes ring BA, reads AB.
	ab, ba, err := reg.Pool.Region().Rings(int(f.A.Slot), f.A.Gen)
	if err != nil {
		t.Fatal(err)
	}
	w, _ := ring.NewWriter(ba, &wait.Policy{})
	rd, _ := ring.NewReader(ab, &wait.Policy{})
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	w.CloseWrite()
	if line, _ := lines.ReadString('\n'); line != fmt.Sprintf("bytes %d crc %d\n", len(data), crc32.ChecksumIEEE(data)) {
		t.Fatalf("C read: %q", line)
	}
	if got, err := io.ReadAll(rd); err != nil || string(got) != "done" {
		t.Fatalf("read from C: %q, %v", got, err)
	}
	cl := s.Expect(t, proto.Close)
	if cl.RegionID != 7 || cl.Slot != f.A.Slot || cl.Gen != f.A.Gen || cl.Side != proto.SideA {
		t.Fatalf("CLOSE = %+v, want region 7 slot %d gen %d side A", cl, f.A.Slot, f.A.Gen)
	}
	s.Send(t, proto.Msg{Type: proto.Unregion, RegionID: 7})
	if line, _ := lines.ReadString('\n'); line != "regions 1 0\n" {
		t.Fatalf("C regions before and after UNREGION: %q, want 1 then 0", line)
	}
}
