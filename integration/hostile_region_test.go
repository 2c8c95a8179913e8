package integration

import (
	"encoding/binary"
	"fmt"
	"github.com/shuntnet/shunt/hostd/config"
	"hash/crc32"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
)

// Attacks on the region model (docs/SECURITY.md, "regions"): a hostile
// guest writes the shared memory it can map (its trust group's region, as
// a VM can, or its own pair regions), speaks the protocol itself, or
// squats the region's path, while honest guests move checksummed data.
// Each test asserts that the attack fails and that the honest guests lose
// nothing: their data arrives intact, their flows stay on the fast path,
// and new honest connections still get it.

// rgEnv is a stack of n guests. shared puts every guest's flows in the
// trust group's region (shared_region = true, as VMs have it), which the
// hostile guest maps and writes like a VM its BAR; otherwise each pair of
// guests gets its own region. group, if not "", holds the trust group's
// attributes besides its region (quotas).
func rgEnv(t *testing.T, n int, shared bool, group string) *env {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	cfg := map[int]string{}
	for i := 1; shared && i <= n; i++ {
		cfg[i] = "shared_region = true"
	}
	rigSeq++
	s, err := stack.Start(stack.Options{
		Name: fmt.Sprintf("r%d%d", os.Getpid()%1000, rigSeq), Guests: n, HostdBin: hostdBin,
		Dir: t.TempDir(), Group: group, GuestConfig: cfg, Logf: t.Logf,
	})
	if err != nil {
		t.Fatalf("start stack: %v", err)
	}
	e := &env{Stack: s, t: t, rig: s.Rig, lns: map[[2]int]*guestlib.Listener{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("hostd log:\n%s", s.Log())
		}
		if err := s.Close(); err != nil {
			t.Errorf("close stack: %v", err)
		}
	})
	return e
}

// rgSteady moves checksummed data from guest a to guest b over one
// fast-path flow until stop is called; stop checks that all of it arrived
// intact and that the flow stayed on the fast path. It also returns the
// client's end, to find the flow.
func (e *env) rgSteady(t *testing.T, a, b, port int) (c *guestlib.Conn, stop func()) {
	t.Helper()
	return e.steady(t, a, b, port, 4<<20) // 4 MiB moved, across the attack, before stopping
}

// rgRoundTrip makes a new connection from guest a to guest b's listener
// on port, moves checksummed bytes both ways, and checks that it took the
// fast path.
func (e *env) rgRoundTrip(t *testing.T, a, b, port int) {
	t.Helper()
	c, s := e.pair(a, b, port)
	defer c.Close()
	defer s.Close()
	if !fastSoon(t, c, s) {
		t.Fatalf("new honest connection %d->%d: paths %s and %s, want the fast path", a, b, c.Path(), s.Path())
	}
	rgExchange(t, c, s)
}

// rgExchange moves 1 MiB each way between c and s and checks it.
func rgExchange(t *testing.T, c, s net.Conn) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i * 31)
	}
	for _, p := range [][2]net.Conn{{c, s}, {s, c}} {
		errc := make(chan error, 1)
		go func() { _, err := p[0].Write(buf); errc <- err }()
		got := make([]byte, len(buf))
		if _, err := io.ReadFull(p[1], got); err != nil || crc32.ChecksumIEEE(got) != crc32.ChecksumIEEE(buf) {
			t.Fatalf("exchange: read %v, checksum %08x want %08x", err, crc32.ChecksumIEEE(got), crc32.ChecksumIEEE(buf))
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}

// rgFlow returns hostd's listing of the flow whose connecting end is c,
// and its region id, slot and generation (parsed from its name:
// group/slot.gen, or group/pID/slot.gen in pair region ID).
func (e *env) rgFlow(t *testing.T, c net.Conn) (fi broker.FlowInfo, id, slot uint32, gen uint64) {
	t.Helper()
	for _, f := range e.flows() {
		if f.Src != c.LocalAddr().String() {
			continue
		}
		rest := strings.TrimPrefix(f.Name, f.Group+"/")
		if p, s, ok := strings.Cut(rest, "/"); ok {
			fmt.Sscanf(p, "p%d", &id)
			rest = s
		}
		if _, err := fmt.Sscanf(rest, "%d.%d", &slot, &gen); err != nil {
			t.Fatalf("flow name %q: %v", f.Name, err)
		}
		return f, id, slot, gen
	}
	t.Fatalf("hostd lists no flow from %s: %+v", c.LocalAddr(), e.flows())
	return
}

// rgRegion maps the trust group's region as a hostile member maps it (a
// VM through its BAR, here the file), to write it.
func (e *env) rgRegion(t *testing.T) *region.Region {
	t.Helper()
	r, err := region.Open(e.RegionPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// Directory slot fields (docs/region.md).
const (
	rgState  = 0
	rgGen    = 8
	rgRingAB = 24
	rgRingBA = 32
)

func rgSlot(r *region.Region, i uint32) []byte {
	off := r.Layout().DirOff + int64(i)*region.SlotSize
	return r.Mem()[off : off+region.SlotSize]
}

// TestHostileReservedSlots: a hostile member writes state Reserved into
// every free slot of its group region's directory. That once turned the
// whole group to tcp(no-space); hostd allocates from its own table, so new
// honest connections still get the fast path and the honest flow moves on.
func TestHostileReservedSlots(t *testing.T) {
	e := rgEnv(t, 3, true, "")
	_, stop := e.rgSteady(t, 3, 2, 7100)
	r := e.rgRegion(t)
	n := 0
	for i := range uint32(r.Layout().Slots) {
		b := rgSlot(r, i)
		if binary.LittleEndian.Uint32(b[rgState:]) == uint32(region.Free) {
			binary.LittleEndian.PutUint32(b[rgState:], uint32(region.Reserved))
			n++
		}
	}
	t.Logf("the hostile guest marked %d free slots Reserved", n)
	for i := range 3 {
		e.rgRoundTrip(t, 3, 2, 7101+i)
	}
	e.rgRoundTrip(t, 1, 2, 7104) // the attacker itself is served as before
	stop()
	if got := e.counter("shunt_fallbacks_total{reason=no-space}"); got != 0 {
		t.Fatalf("no-space fallbacks: %v, want 0", got)
	}
}

// TestHostileRingOffsetsRedirect: a hostile member points its own flow's
// ring offsets in the directory at an honest flow's rings and closes its
// flow. hostd once freed the honest flow's chunks and formatted new rings
// over them; it frees what its own record says, so the honest flow moves
// on intact and new flows land elsewhere.
func TestHostileRingOffsetsRedirect(t *testing.T) {
	e := rgEnv(t, 3, true, "")
	vc, stop := e.rgSteady(t, 3, 2, 7200)
	_, _, vslot, vgen := e.rgFlow(t, vc)
	r := e.rgRegion(t)
	victim, err := r.Entry(int(vslot))
	if err != nil || victim.Gen != vgen {
		t.Fatalf("victim's slot %d: %+v, %v", vslot, victim, err)
	}
	ac, as := e.pair(1, 2, 7201)
	if !fastSoon(t, ac, as) {
		t.Fatalf("attacker's flow: %s / %s", ac.Path(), as.Path())
	}
	_, _, aslot, _ := e.rgFlow(t, ac)
	b := rgSlot(r, aslot)
	binary.LittleEndian.PutUint64(b[rgRingAB:], uint64(victim.RingAB))
	binary.LittleEndian.PutUint64(b[rgRingBA:], uint64(victim.RingBA))
	ac.Close()
	as.Close()
	eventually(t, 5*time.Second, "the attacker's flow freed", func() bool { return len(e.flows()) == 1 })
	// New flows, which would land on the victim's rings if hostd had
	// freed them.
	vs, ve := victim.Span()
	for i := range 3 {
		c, s := e.pair(1, 2, 7202+i)
		if !fastSoon(t, c) {
			t.Fatalf("attacker's new flow: %s", c.Path())
		}
		_, _, slot, gen := e.rgFlow(t, c)
		ne, err := r.Entry(int(slot))
		if err != nil || ne.Gen != gen {
			t.Fatalf("new flow's slot %d: %+v, %v", slot, ne, err)
		}
		if ns, nend := ne.Span(); ns < ve && vs < nend {
			t.Fatalf("a new flow's rings [%d, %d) overlap the victim's [%d, %d)", ns, nend, vs, ve)
		}
		rgExchange(t, c, s)
	}
	stop()
}

// TestHostileGenerationRewrite: a hostile member rewrites an honest flow's
// slot as free with the generation before its own (and marks the other
// free slots Reserved, so that the slot is the only one "free"). hostd once
// handed out that slot and generation again, and a later conntrack DESTROY
// for the first flow then reset the innocent second one. hostd's
// generations are its own and never repeat: the DESTROY moves only the
// connection it belongs to to TCP.
func TestHostileGenerationRewrite(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	e := rgEnv(t, 3, true, "")
	vc, vs := e.pair(3, 2, 7300)
	// Both ends must have checked their READY against the directory
	// before the attacker rewrites it.
	if !fastSoon(t, vc, vs) {
		t.Fatalf("victim's flow: %s / %s, want the fast path", vc.Path(), vs.Path())
	}
	_, _, vslot, vgen := e.rgFlow(t, vc)
	r := e.rgRegion(t)
	for i := range uint32(r.Layout().Slots) {
		b := rgSlot(r, i)
		switch {
		case i == vslot:
			binary.LittleEndian.PutUint64(b[rgGen:], vgen-1)
			binary.LittleEndian.PutUint32(b[rgState:], uint32(region.Free))
		case binary.LittleEndian.Uint32(b[rgState:]) == uint32(region.Free):
			binary.LittleEndian.PutUint32(b[rgState:], uint32(region.Reserved))
		}
	}
	// The innocent flow, opened after the scribbling.
	ic, is := e.pair(3, 2, 7301)
	if !fastSoon(t, ic, is) {
		t.Fatalf("innocent flow: %s / %s, want the fast path", ic.Path(), is.Path())
	}
	_, _, islot, igen := e.rgFlow(t, ic)
	if islot == vslot && igen == vgen {
		t.Fatalf("the innocent flow got the victim's slot %d and generation %d", vslot, vgen)
	}
	e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7300")
	onTCP(t, "the victim's ends on TCP after its conntrack entry went", vc, vs)
	rgExchange(t, ic, is) // untouched by the victim's DESTROY
	for _, f := range e.flows() {
		if f.Src == ic.LocalAddr().String() && f.State != "ready" {
			t.Fatalf("innocent flow %+v, want ready", f)
		}
	}
	if !fastSoon(t, ic, is) {
		t.Fatalf("innocent flow left the fast path: %s / %s", ic.Path(), is.Path())
	}
}

// TestHostilePairRegionUnreachable: process guests get a region per peer
// pair. A hostile guest cannot reach the rings of a flow between two other
// guests: WELCOME names no region to it, it is never handed the pair's
// region, the pair's region is a memfd with no path, and
// naming the pair's region in REATTACH, CLOSE or KICK gets it nothing
// (DOWN, or no effect), while the pair's flow moves on.
func TestHostilePairRegionUnreachable(t *testing.T) {
	e := rgEnv(t, 3, false, "")
	vc, stop := e.rgSteady(t, 3, 2, 7400)
	fi, id, slot, gen := e.rgFlow(t, vc)
	if id == 0 {
		t.Fatalf("the pair's flow %s is in the group region, want a pair region", fi.Name)
	}
	rogue, err := rgDial(e.Control(e.rig.Guests[0]))
	if err != nil {
		t.Fatal(err)
	}
	defer rogue.Close()
	w := rogue.hello(t)
	if w.Region != "" || w.RegionSize != 0 {
		t.Fatalf("WELCOME to a process guest names region %q (%d bytes): it could map it", w.Region, w.RegionSize)
	}
	local, remote := netip.MustParseAddrPort(fi.Src), netip.MustParseAddrPort(fi.Dst)
	for _, side := range []proto.Side{proto.SideA, proto.SideB} {
		rogue.send(t, proto.Msg{Type: proto.Reattach, RegionID: id, Slot: slot, Gen: gen, Side: side, Local: local, Remote: remote})
		if m := rogue.next(t); m.Type != proto.Down || m.RegionID != id {
			t.Fatalf("REATTACH of another pair's flow: %+v, want DOWN", m)
		}
		rogue.send(t, proto.Msg{Type: proto.Close, RegionID: id, Slot: slot, Gen: gen, Side: side},
			proto.Msg{Type: proto.Kick, RegionID: id, Slot: slot, Gen: gen, Side: side})
	}
	rogue.send(t, proto.Msg{Type: proto.Ping, Nonce: 9})
	for {
		m := rogue.next(t)
		if m.Type == proto.RegionMsg {
			t.Fatalf("the hostile guest was handed region %d", m.RegionID)
		}
		if m.Type == proto.Pong {
			break
		}
	}
	// The pair's region has no path at all: a sealed memfd, held by hostd
	// and the pair's two guests only. region_dir holds no file of it.
	if files, err := os.ReadDir(e.RegionDir()); err != nil || len(files) != 0 {
		t.Fatalf("region_dir %s: %v, %v; want no file (process pair regions are memfds)", e.RegionDir(), files, err)
	}
	if st, err := os.Stat(e.RegionDir()); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("region_dir mode: %v, %v; want 0700", st.Mode(), err)
	}
	stop()
	for _, f := range e.flows() {
		if f.Name == fi.Name && f.Attached != "ab" {
			t.Fatalf("the pair's flow after the attack: %+v", f)
		}
	}
}

// TestHostileQuota: a hostile member of a group region opens connection
// after connection. With the default quota (a quarter of the region per
// guest) it gets a few on the fast path and the rest stay on TCP, counted
// as guest-quota; the honest guests keep the fast path for old and new
// connections. Once it closes its flows, it gets the fast path again.
func TestHostileQuota(t *testing.T) {
	// A 32 MiB region holds 15 flows of 1 MiB rings; the default quota
	// (room for one flow of the largest rule's ring and DefaultFloorFlows
	// more of the default: 4 flows here, a little over a quarter of the
	// region) is 4 of them.
	e := rgEnv(t, 3, true, "  pair_slots = 64\n")
	_, stop := e.rgSteady(t, 3, 2, 7500)
	var fast, quota int
	var held []net.Conn
	for i := range 20 {
		c, s := e.pair(1, 2, 7501)
		held = append(held, c, s)
		switch p := settled(t, c); {
		case p.Fast:
			fast++
		case p.Reason == proto.ReasonGuestQuota.String():
			quota++
		default:
			t.Fatalf("attacker's connection %d: %s", i, p)
		}
	}
	if fast != 1+config.DefaultFloorFlows || quota != 20-fast {
		t.Fatalf("attacker got %d fast and %d guest-quota connections, want %d and %d", fast, quota, 1+config.DefaultFloorFlows, 19-config.DefaultFloorFlows)
	}
	for i := range 4 {
		e.rgRoundTrip(t, 3, 2, 7502+i)
	}
	if got := e.counter("shunt_fallbacks_total{reason=guest-quota}"); got != float64(quota) {
		t.Fatalf("guest-quota fallbacks: %v, want %d (once per connection)", got, quota)
	}
	if got := e.counter("shunt_fallbacks_total{reason=no-space}"); got != 0 {
		t.Fatalf("no-space fallbacks: %v, want 0", got)
	}
	stop()
	for _, c := range held {
		c.Close()
	}
	eventually(t, 5*time.Second, "the attacker's flows freed", func() bool {
		for _, f := range e.flows() {
			if f.GuestA == e.rig.Guests[0].Name {
				return false
			}
		}
		return true
	})
	e.rgRoundTrip(t, 1, 2, 7510)
}

// TestHostileRegionSquat: a local user creates the group region's file
// before hostd (readable by all), or puts a symlink there. hostd refuses
// both, says what to remove, and touches neither the file nor what the
// link points at; once the path is clear it creates the region itself.
func TestHostileRegionSquat(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	rigSeq++
	name := fmt.Sprintf("q%d%d", os.Getpid()%1000, rigSeq)
	path := "/dev/shm/shunt-" + name
	dir := t.TempDir()
	t.Cleanup(func() { os.Remove(path) })
	start := func() (*stack.Stack, error) {
		return stack.Start(stack.Options{Name: name, Guests: 2, HostdBin: hostdBin, Dir: t.TempDir(), Logf: t.Logf})
	}
	target := filepath.Join(dir, "precious")
	for _, tc := range []struct {
		name, want string
		plant      func() error
		check      func() error
	}{
		{"squatted file", "owned by uid 65534", func() error {
			if err := os.WriteFile(path, []byte("the squatter's"), 0o666); err != nil {
				return err
			}
			if err := os.Chmod(path, 0o666); err != nil {
				return err
			}
			return os.Chown(path, 65534, 65534)
		}, func() error {
			b, err := os.ReadFile(path)
			if err != nil || string(b) != "the squatter's" {
				return fmt.Errorf("the squatted file now holds %q (%v)", b, err)
			}
			return nil
		}},
		{"symlink", "is a symlink", func() error {
			if err := os.WriteFile(target, []byte("precious"), 0o644); err != nil {
				return err
			}
			return os.Symlink(target, path)
		}, func() error {
			b, err := os.ReadFile(target)
			if err != nil || string(b) != "precious" {
				return fmt.Errorf("the symlink's target now holds %d bytes (%v)", len(b), err)
			}
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			os.Remove(path)
			if err := tc.plant(); err != nil {
				t.Fatal(err)
			}
			s, err := start()
			if err == nil {
				s.Close()
				t.Fatalf("hostd started over a %s at %s", tc.name, path)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "rm "+path) {
				t.Fatalf("hostd's refusal does not say %q and what to remove (rm %s):\n%v", tc.want, path, err)
			}
			if err := tc.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
	// The path cleared, hostd makes the region its own.
	os.Remove(path)
	s, err := start()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil || st.Uid != 0 || st.Mode&0o777 != 0o600 || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		t.Fatalf("hostd's region: uid %d mode %o (%v); want root's, 0600, a regular file", st.Uid, st.Mode, err)
	}
}

// rgRogue is a hostile guest's raw control session.
type rgRogue struct {
	net.Conn
	buf []byte
}

func rgDial(sock string) (*rgRogue, error) {
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		return nil, err
	}
	return &rgRogue{Conn: c}, nil
}

func (r *rgRogue) send(t *testing.T, ms ...proto.Msg) {
	t.Helper()
	var b []byte
	for _, m := range ms {
		var err error
		if b, err = m.Append(b); err != nil {
			t.Fatal(err)
		}
	}
	_ = r.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.Write(b); err != nil {
		t.Fatal(err)
	}
}

// next reads one message, skipping hostd's keepalive PINGs (answered).
func (r *rgRogue) next(t *testing.T) proto.Msg {
	t.Helper()
	for {
		_ = r.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, buf, err := proto.Read(r, r.buf)
		r.buf = buf
		if err != nil {
			t.Fatalf("hostile session: %v", err)
		}
		if m.Type != proto.Ping {
			return m
		}
		r.send(t, proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
	}
}

func (r *rgRogue) hello(t *testing.T) proto.Msg {
	t.Helper()
	r.send(t, proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion})
	m := r.next(t)
	if m.Type != proto.Welcome {
		t.Fatalf("answer to HELLO: %+v", m)
	}
	return m
}
