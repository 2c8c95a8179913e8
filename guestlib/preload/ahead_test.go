package preload

import (
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

var aheadRE = regexp.MustCompile(`held ahead (\d+)`)

// TestAheadAfterDown: the peer's writer started its ring at stream offset
// S while TCP bytes before S are still in flight (a firewall drops them,
// and their retransmissions: the test withholds them), wrote the ring and
// left it; hostd says DOWN (firewall). The C end (the edge server's stream
// test under the library: its reader waits in recv, in poll, or in an
// edge-triggered epoll) may not read the ring before those TCP bytes, but
// must not hold it either: hostd takes a retired region's memory back
// after its grace, and gives the connection rings again only after LEFT.
// So LEFT must reach hostd while the TCP bytes are still withheld (the
// reader copied the ring's stretch aside); then the test sends them and
// the rest of the stream on TCP, and the server must see every byte in
// order, the stretch counted as ring bytes.
func TestAheadAfterDown(t *testing.T) {
	lib, edge := buildPreload(t)
	for i, tc := range []struct {
		mode      string
		downFirst bool // DOWN before the writer's leave: the leaver thread finds it
	}{
		{"stream", false},
		{"stream", true},
		{"streampoll", true},
		{"streamet", false},
	} {
		t.Run(fmt.Sprintf("%s/down first %v", tc.mode, tc.downFirst), func(t *testing.T) {
			r := startResume(t, lib, edge, uint64(300+i), false, true)
			r.size = 256 << 10
			runAhead(t, r, tc.mode, tc.downFirst)
		})
	}
}

// runAhead plays one case of TestAheadAfterDown on r's server.
func runAhead(t *testing.T, r *resumeRig, mode string, downFirst bool) {
	name := fmt.Sprintf("%s %d %d\n", mode, r.seed, r.size)
	stream := make([]byte, r.size)
	newGen(r.seed, 0).Fill(stream) // what the server checks
	go io.Copy(io.Discard, r.tcp)  // the server's own stream, on TCP: this end never attaches its reader
	if _, err := r.tcp.Write([]byte(name)); err != nil {
		t.Fatal(err)
	}
	sent := 0
	tcp := func(p []byte) {
		t.Helper()
		if _, err := r.tcp.Write(p); err != nil {
			t.Fatalf("TCP write at %d: %v\n%s", sent, err, r.state())
		}
		sent += len(p)
	}
	// A reader asleep in the kernel's recv when READY came marks its ring
	// attached once a byte wakes it.
	for end := time.Now().Add(guesttest.Wait); !r.pw.ReaderAttached(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("the server's reader never attached its ring\n%s", r.state())
		}
		tcp(stream[sent : sent+1000])
	}
	const withheld, ringBytes = 5000, 30000
	held := stream[sent : sent+withheld]
	start := uint64(len(name) + sent + withheld)
	r.pw.Start(start)
	if _, err := r.pw.Write(stream[sent+withheld : sent+withheld+ringBytes]); err != nil {
		t.Fatal(err)
	}
	rest := stream[sent+withheld+ringBytes:]
	if !downFirst {
		_ = r.pw.Leave()
	}
	r.s.Send(t, guesttest.Down(r.f.B, proto.ReasonFirewall))
	if downFirst {
		_ = r.pw.Leave()
	}
	for {
		m, err := r.s.Read(guesttest.Wait)
		if err != nil {
			t.Fatalf("no LEFT after DOWN while the server's reader waits for TCP bytes [%d, %d) before its ring's stretch: %v\n%s",
				len(name)+sent, start, err, r.state())
		}
		if m.Type == proto.Left {
			if m.Slot != r.f.B.Slot || m.Gen != r.f.B.Gen || m.ReqID != r.f.B.ReqID {
				t.Fatalf("LEFT %+v, want %+v's", m, r.f.B)
			}
			break
		}
	}
	// The firewall's rule goes: TCP's retransmission of the withheld
	// bytes, then the rest of the stream (after the ring's stretch).
	tcp(held)
	tcp(rest)
	_ = r.tcp.CloseWrite()
	verdict := mode + "-server"
	for end := time.Now().Add(60 * time.Second); !strings.Contains(r.out.String(), " stats: read "); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("no verdict and stats line from the server\n%s", r.state())
		}
	}
	out := r.out.String()
	if !strings.Contains(out, "PASS "+verdict) {
		t.Fatalf("the server's verdict\n%s", r.state())
	}
	rd, _ := pathStats(t, out)
	if want := uint64(len(name) + r.size); rd[0]+rd[1] != want || rd[1] != ringBytes {
		t.Errorf("the server read %d TCP + %d ring bytes, want %d in all, %d of them from the ring\n%s", rd[0], rd[1], want, ringBytes, r.state())
	}
	if m := aheadRE.FindStringSubmatch(out); m == nil || m[1] != strconv.Itoa(1) {
		t.Errorf("stats: %q, want the ring's stretch held ahead once\n%s", m, r.state())
	}
}
