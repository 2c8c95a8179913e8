package virt_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/virt"
)

// fakeLibvirt is a libvirtd for the watcher's logic: a set of running
// domains, lifecycle events, and a connection that can be cut.
type fakeLibvirt struct {
	mu      sync.Mutex
	domains map[string][]byte
	down    bool
	conn    *fakeSource
}

type fakeSource struct {
	lv     *fakeLibvirt
	events chan struct{}
	once   sync.Once
}

func (lv *fakeLibvirt) dial(context.Context) (virt.Source, error) {
	lv.mu.Lock()
	defer lv.mu.Unlock()
	if lv.down {
		return nil, errors.New("connection refused")
	}
	lv.conn = &fakeSource{lv: lv, events: make(chan struct{}, 16)}
	return lv.conn, nil
}

func (s *fakeSource) Active() (map[string][]byte, error) {
	s.lv.mu.Lock()
	defer s.lv.mu.Unlock()
	if s.lv.down {
		return nil, errors.New("broken pipe")
	}
	out := map[string][]byte{}
	for k, v := range s.lv.domains {
		out[k] = v
	}
	return out, nil
}
func (s *fakeSource) Events() <-chan struct{} { return s.events }
func (s *fakeSource) Close() error            { s.once.Do(func() { close(s.events) }); return nil }

// set changes the running domains and sends an event.
func (lv *fakeLibvirt) set(name, xml string) {
	lv.mu.Lock()
	if xml == "" {
		delete(lv.domains, name)
	} else {
		lv.domains[name] = []byte(xml)
	}
	c := lv.conn
	down := lv.down
	lv.mu.Unlock()
	if c != nil && !down {
		c.events <- struct{}{}
	}
}

// restart cuts the connection; domains may change while it is down.
func (lv *fakeLibvirt) stop() {
	lv.mu.Lock()
	lv.down = true
	c := lv.conn
	lv.conn = nil
	lv.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

func (lv *fakeLibvirt) start() {
	lv.mu.Lock()
	lv.down = false
	lv.mu.Unlock()
}

// fakeRegistry records what the watcher did; it refuses names in refuse.
type fakeRegistry struct {
	mu     sync.Mutex
	guests map[string]virt.Domain
	log    []string
	refuse map[string]bool
}

func (r *fakeRegistry) Register(d virt.Domain) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.refuse[d.Name] {
		return errors.New("refused")
	}
	if _, ok := r.guests[d.Name]; ok {
		panic("registered twice: " + d.Name)
	}
	r.guests[d.Name] = d
	r.log = append(r.log, "+"+d.Name)
	return nil
}

func (r *fakeRegistry) Unregister(d virt.Domain) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.guests[d.Name]; !ok {
		panic("unregistered an unknown domain: " + d.Name)
	}
	delete(r.guests, d.Name)
	r.log = append(r.log, "-"+d.Name)
}

func (r *fakeRegistry) names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for n := range r.guests {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func shuntDomain(name, sock string) string {
	return domainXML(name, "", strings.Replace(channel, "/run/shunt/vm1.sock", sock, 1))
}

func TestWatcherFollowsLibvirt(t *testing.T) {
	lv := &fakeLibvirt{domains: map[string][]byte{
		"vm1": []byte(shuntDomain("vm1", "/run/shunt/vm1.sock")),
		"web": []byte(domainXML("web", "", "")),
	}}
	reg := &fakeRegistry{guests: map[string]virt.Domain{}}
	w := virt.NewWatcher(hclog.NewNullLogger(), lv.dial, reg, virt.Options{Retry: time.Millisecond, Tick: time.Hour})
	if err := w.Start(context.Background(), time.Second); err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// Start returns after the first reconcile: vm1 is there already.
	if got := reg.names(); !slices.Equal(got, []string{"vm1"}) {
		t.Fatalf("after Start: %v", got)
	}

	lv.set("vm2", shuntDomain("vm2", "/run/shunt/vm2.sock"))
	eventually(t, "vm2 registered", func() bool { return slices.Equal(reg.names(), []string{"vm1", "vm2"}) })
	lv.set("vm1", "")
	eventually(t, "vm1 released", func() bool { return slices.Equal(reg.names(), []string{"vm2"}) })

	// A changed domain is registered again with its new description.
	lv.set("vm2", shuntDomain("vm2", "/run/shunt/vm2-new.sock"))
	eventually(t, "vm2 re-registered", func() bool {
		reg.mu.Lock()
		defer reg.mu.Unlock()
		return slices.Equal(reg.guests["vm2"].Controls, []string{"/run/shunt/vm2-new.sock"})
	})

	// libvirtd restarts; meanwhile vm2 stops and vm3 starts. The
	// registered guests stay while it is down; the reconnect resyncs.
	lv.stop()
	eventually(t, "disconnected", func() bool { return !w.Status().Connected })
	if got := reg.names(); !slices.Equal(got, []string{"vm2"}) {
		t.Fatalf("while libvirtd is down: %v", got)
	}
	lv.set("vm2", "")
	lv.set("vm3", shuntDomain("vm3", "/run/shunt/vm3.sock"))
	lv.start()
	eventually(t, "resync after reconnect", func() bool { return slices.Equal(reg.names(), []string{"vm3"}) })
	st := w.Status()
	if !st.Connected || !slices.Equal(st.Domains, []string{"vm3"}) || st.Syncs < 4 {
		t.Fatalf("status %+v", st)
	}
	reg.mu.Lock()
	want := []string{"+vm1", "+vm2", "-vm1", "-vm2", "+vm2", "-vm2", "+vm3"}
	if !slices.Equal(reg.log, want) {
		t.Fatalf("registry calls %v, want %v", reg.log, want)
	}
	reg.mu.Unlock()
}

func TestWatcherRetriesRefusedAndBrokenDomains(t *testing.T) {
	lv := &fakeLibvirt{domains: map[string][]byte{
		"vm1": []byte(shuntDomain("vm1", "relative.sock")),
		"vm2": []byte(shuntDomain("vm2", "/run/shunt/vm2.sock")),
	}}
	reg := &fakeRegistry{guests: map[string]virt.Domain{}, refuse: map[string]bool{"vm2": true}}
	w := virt.NewWatcher(hclog.NewNullLogger(), lv.dial, reg, virt.Options{Retry: time.Millisecond, Tick: 5 * time.Millisecond})
	if err := w.Start(context.Background(), time.Second); err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if got := reg.names(); len(got) != 0 {
		t.Fatalf("registered %v", got)
	}
	// Fixing the cause is enough: the next reconcile takes them.
	reg.mu.Lock()
	reg.refuse = nil
	reg.mu.Unlock()
	lv.set("vm1", shuntDomain("vm1", "/run/shunt/vm1.sock"))
	eventually(t, "both registered", func() bool { return slices.Equal(reg.names(), []string{"vm1", "vm2"}) })
}

func TestWatcherStartsWithoutLibvirtd(t *testing.T) {
	lv := &fakeLibvirt{domains: map[string][]byte{"vm1": []byte(shuntDomain("vm1", "/run/shunt/vm1.sock"))}, down: true}
	reg := &fakeRegistry{guests: map[string]virt.Domain{}}
	w := virt.NewWatcher(hclog.NewNullLogger(), lv.dial, reg, virt.Options{Retry: time.Millisecond, Tick: time.Hour})
	if err := w.Start(context.Background(), 10*time.Millisecond); err == nil {
		t.Fatal("Start reported success with libvirtd down")
	}
	defer w.Close()
	if st := w.Status(); st.Connected || !strings.Contains(st.LastError, "connection refused") {
		t.Fatalf("status %+v", st)
	}
	lv.start()
	eventually(t, "registered once libvirtd is up", func() bool { return slices.Equal(reg.names(), []string{"vm1"}) })
}

// TestWatcherFollowsTap: a domain that comes back on another tap (it was
// restarted, or migrated here) is released and registered again with the
// new tap, so hostd's mark rule follows it; a domain that takes over a tap
// of a stopped one in the same step is registered only after the stopped
// one is released (an interface has one guest at a time).
func TestWatcherFollowsTap(t *testing.T) {
	onTap := func(name, tap string) string {
		return strings.Replace(shuntDomain(name, "/run/shunt/"+name+".sock"), "<target dev='shlv1'/>", "<target dev='"+tap+"'/>", 1)
	}
	lv := &fakeLibvirt{domains: map[string][]byte{"vm1": []byte(onTap("vm1", "vnet0"))}}
	reg := &fakeRegistry{guests: map[string]virt.Domain{}}
	w := virt.NewWatcher(hclog.NewNullLogger(), lv.dial, reg, virt.Options{Retry: time.Millisecond, Tick: time.Hour})
	if err := w.Start(context.Background(), time.Second); err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	tapOf := func(name string) string {
		reg.mu.Lock()
		defer reg.mu.Unlock()
		return reg.guests[name].Tap
	}
	lv.set("vm1", onTap("vm1", "vnet3"))
	eventually(t, "vm1 on its new tap", func() bool { return tapOf("vm1") == "vnet3" })
	// vm1 stops and vm2 starts on vnet3 while libvirtd is away: one step.
	lv.stop()
	eventually(t, "disconnected", func() bool { return !w.Status().Connected })
	lv.mu.Lock()
	delete(lv.domains, "vm1")
	lv.domains["vm2"] = []byte(onTap("vm2", "vnet3"))
	lv.mu.Unlock()
	lv.start()
	eventually(t, "vm2 on vnet3", func() bool { return tapOf("vm2") == "vnet3" })
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if want := []string{"+vm1", "-vm1", "+vm1", "-vm1", "+vm2"}; !slices.Equal(reg.log, want) {
		t.Fatalf("registry calls %v, want %v", reg.log, want)
	}
}
