package across

import (
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/relay"
)

// deregVerbs is a queue pair that carries nothing: enough for a link to
// register memory on, recording when registrations go.
type deregVerbs struct {
	send, recv []byte
	credit     [2]uint64
	note       func(string)
}

func (v *deregVerbs) Local() relay.Endpoint {
	return relay.Endpoint{QPN: 1, MTU: 5, Size: relay.MinRing, Depth: relay.MinDepth}
}
func (v *deregVerbs) Connect(relay.Endpoint) error         { return nil }
func (v *deregVerbs) Send() []byte                         { return v.send }
func (v *deregVerbs) Recv() []byte                         { return v.recv }
func (v *deregVerbs) Credit() *[2]uint64                   { return &v.credit }
func (v *deregVerbs) Write(int, int) error                 { return nil }
func (v *deregVerbs) WriteCredit(uint64, uint64) error     { return nil }
func (v *deregVerbs) PostRecv(int) error                   { return nil }
func (v *deregVerbs) Poll([]relay.Completion) (int, error) { return 0, nil }
func (v *deregVerbs) Sleep(d time.Duration) error          { time.Sleep(min(d, time.Millisecond)); return nil }
func (v *deregVerbs) Close() error                         { return nil }
func (v *deregVerbs) MaxSGE() int                          { return 16 }
func (v *deregVerbs) Register([]byte) (uint32, error)      { return 1, nil }
func (v *deregVerbs) Deregister(uint32) error              { v.note("deregister"); return nil }
func (v *deregVerbs) WriteSG(int, int, []relay.SGE) error  { return nil }

// TestUnmapDeregistersFirst: a region the relay takes away (UNREGION, or
// a new region of its id) loses its registration on the RDMA link before
// its mapping goes, and the session forgets both.
func TestUnmapDeregistersFirst(t *testing.T) {
	var mu sync.Mutex
	var events []string
	note := func(s string) { mu.Lock(); events = append(events, s); mu.Unlock() }
	unmapped := make(chan struct{})
	old := munmap
	munmap = func([]byte) error { note("munmap"); close(unmapped); return nil }
	defer func() { munmap = old }()

	v := &deregVerbs{send: make([]byte, relay.MinRing), recv: make([]byte, relay.MinRing), note: note}
	lk := relay.NewRDMALink(v, relay.RDMAOptions{})
	defer func() { lk.Close(); lk.Wait() }()
	mem := make([]byte, 1<<20)
	reg, err := lk.Register(mem)
	if err != nil {
		t.Fatal(err)
	}
	s := &session{regions: map[uint32][]byte{7: mem}, regs: map[uint32]*relay.Region{7: reg}}
	if s.region(7, lk) != reg || s.region(7, nil) != nil {
		t.Fatal("the session's registration is not the link's")
	}
	delete(s.regions, 7)
	s.unmap(7, mem)
	select {
	case <-unmapped:
	case <-time.After(10 * time.Second):
		t.Fatal("the region was not unmapped within 10s")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(events) != 2 || events[0] != "deregister" || events[1] != "munmap" {
		t.Fatalf("events %v; want [deregister munmap]", events)
	}
	if s.regs[7] != nil {
		t.Fatal("the session still has the registration")
	}
}
