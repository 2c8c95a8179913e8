package virt_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/virt/virttest"
)

// is matches the one name.
func is(name string) func(string) bool { return func(s string) bool { return s == name } }

func TestShmemXMLRoundTrip(t *testing.T) {
	want := virt.Shmem{Name: virt.PairShmem(3, 7, 1), Alias: virt.UserAlias("shunt-p1-x"), Size: 16 << 20}
	x := want.XML()
	for _, s := range []string{"<shmem name='shunt-pair-3-7-p1'>", "<model type='ivshmem-plain'/>", "<size unit='M'>16</size>", "<alias name='ua-shunt-p1-x'/>"} {
		if !strings.Contains(x, s) {
			t.Fatalf("XML %q lacks %q", x, s)
		}
	}
	got, err := virt.Shmems([]byte("<domain><devices>" + x + "</devices></domain>"))
	if err != nil || len(got) != 1 || got[0] != want {
		t.Fatalf("Shmems(XML) = %+v, %v; want [%+v]", got, err, want)
	}
	for _, tc := range []struct {
		unit string
		n    int64
		want int64
	}{{"M", 32, 32 << 20}, {"G", 1, 1 << 30}, {"KiB", 1024, 1 << 20}, {"", 4096, 4096}} {
		x := fmt.Sprintf("<domain><devices><shmem name='a'><size unit='%s'>%d</size></shmem></devices></domain>", tc.unit, tc.n)
		if s, err := virt.Shmems([]byte(x)); err != nil || s[0].Size != tc.want {
			t.Fatalf("size %d %s: got %+v, %v; want %d bytes", tc.n, tc.unit, s, err, tc.want)
		}
	}
}

// TestParseDomainIgnoresPairShmem: hostd's pair region devices come and
// go while a domain runs; the domain's description (and so the watcher's
// idea of whether it changed) stays the same.
func TestParseDomainIgnoresPairShmem(t *testing.T) {
	base := domainXML("vm1", "", channel)
	plugged := strings.Replace(base, "</devices>", virt.Shmem{Name: virt.PairShmem(1, 2, 1), Alias: "ua-shunt-p1-x", Size: 16 << 20}.XML()+"</devices>", 1)
	a, err := virt.ParseDomain([]byte(base))
	if err != nil {
		t.Fatal(err)
	}
	b, err := virt.ParseDomain([]byte(plugged))
	if err != nil {
		t.Fatal(err)
	}
	if !a.Equal(b) {
		t.Fatalf("a plugged pair region changed the domain: %+v, then %+v", a, b)
	}
}

// TestParseDomainPairGroup: a domain of a group with pair regions has no
// <shmem> of its own and names its group in the metadata; without either
// it is refused with what to do.
func TestParseDomainPairGroup(t *testing.T) {
	noShmem := func(meta string) string {
		x := domainXML("vm1", meta, channel)
		i, j := strings.Index(x, "<shmem"), strings.Index(x, "</shmem>")+len("</shmem>")
		return x[:i] + x[j:]
	}
	d, err := virt.ParseDomain([]byte(noShmem(virt.Metadata{Group: "p"}.XML())))
	if err != nil || d.Group != "p" || len(d.Shmem) != 0 {
		t.Fatalf("got %+v, %v; want group p and no shmem", d, err)
	}
	_, err = virt.ParseDomain([]byte(noShmem("")))
	if err == nil || !strings.Contains(err.Error(), "<shunt:group>") {
		t.Fatalf("err = %v, want one that says to name the group", err)
	}
}

func TestPluggerAttachLive(t *testing.T) {
	f := virttest.New("vm1")
	p := f.Plugger()
	s := virt.Shmem{Name: virt.PairShmem(1, 2, 1), Alias: "ua-shunt-p1-x", Size: 16 << 20}
	if err := p.Attach(context.Background(), "vm1", s); err != nil {
		t.Fatal(err)
	}
	if got := f.Devices("vm1"); len(got) != 1 || got[0] != s {
		t.Fatalf("vm1 has %+v, want [%+v]", got, s)
	}
	if want := fmt.Sprintf("attach vm1 flags=%d", libvirt.DomainAffectLive); f.CallLog()[0] != want {
		t.Fatalf("call %q, want %q (live only: the persistent definition keeps no trace)", f.CallLog()[0], want)
	}
	if err := p.Attach(context.Background(), "gone", s); !errors.Is(err, virt.ErrDomainGone) {
		t.Fatalf("attach to a domain not running: %v, want ErrDomainGone", err)
	}
}

// TestPluggerDetachWaits: Detach takes out every device of the name by
// its alias (one from an earlier hostd too) and returns only once the
// live XML no longer lists them; other devices stay.
func TestPluggerDetachWaits(t *testing.T) {
	f := virttest.New("vm1")
	p := f.Plugger()
	name := virt.PairShmem(1, 2, 1)
	for _, s := range []virt.Shmem{{Name: name, Alias: "ua-shunt-p1-old", Size: 16 << 20}, {Name: "shunt-t", Alias: "shmem0", Size: 32 << 20}, {Name: name, Alias: "ua-shunt-p2-new", Size: 16 << 20}} {
		if err := p.Attach(context.Background(), "vm1", s); err != nil {
			t.Fatal(err)
		}
	}
	n, err := p.Detach(context.Background(), "vm1", is(name))
	if err != nil || n != 2 {
		t.Fatalf("Detach = %d, %v; want 2, nil", n, err)
	}
	if got := f.Devices("vm1"); len(got) != 1 || got[0].Name != "shunt-t" {
		t.Fatalf("vm1 has %+v after the detach, want only shunt-t", got)
	}
	if n, err := p.Detach(context.Background(), "vm1", is(name)); n != 0 || err != nil {
		t.Fatalf("Detach of a device not there = %d, %v; want 0, nil", n, err)
	}
}

func TestPluggerDetachGoneDomain(t *testing.T) {
	p := virttest.New().Plugger()
	if n, err := p.Detach(context.Background(), "gone", is(virt.PairShmem(1, 2, 1))); n != 0 || err != nil {
		t.Fatalf("Detach from a domain not running = %d, %v; want 0, nil", n, err)
	}
}

// TestPluggerDetachBounded: a guest that never ejects the device makes
// Detach fail when ctx ends, naming the device still there.
func TestPluggerDetachBounded(t *testing.T) {
	f := virttest.New("vm1")
	f.EjectAfter = -1
	p := f.Plugger()
	name := virt.PairShmem(1, 2, 1)
	if err := p.Attach(context.Background(), "vm1", virt.Shmem{Name: name, Alias: "ua-x", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := p.Detach(ctx, "vm1", is(name))
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "ua-x") {
		t.Fatalf("Detach = %v, want the deadline and the alias still there", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("Detach took %v past a 200ms deadline", took)
	}
}

// TestPluggerRedials: a connection that ended is made again at the next
// call.
func TestPluggerRedials(t *testing.T) {
	f := virttest.New("vm1")
	dials := 0
	var gone chan struct{}
	p := virt.NewPluggerAPI(func() (virt.API, <-chan struct{}, func() error, error) {
		dials++
		gone = make(chan struct{})
		return f, gone, func() error { return nil }, nil
	})
	s := virt.Shmem{Name: "a", Alias: "ua-a", Size: 1 << 20}
	if err := p.Attach(context.Background(), "vm1", s); err != nil {
		t.Fatal(err)
	}
	if err := p.Attach(context.Background(), "vm1", virt.Shmem{Name: "b", Alias: "ua-b", Size: 1 << 20}); err != nil || dials != 1 {
		t.Fatalf("second call: %v, %d dials; want one connection", err, dials)
	}
	close(gone)
	if _, err := p.Detach(context.Background(), "vm1", is("a")); err != nil || dials != 2 {
		t.Fatalf("after the connection ended: %v, %d dials; want a new one", err, dials)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}
