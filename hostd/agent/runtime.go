package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/server"
)

// Guests added at run time (`hostd guest add`, the CNI plugin): process
// and container guests known by their network namespace. They take the
// same path as configured and libvirt guests (witness, mark id, broker,
// control socket), and hostd keeps each spec in state_dir/guests, so that a
// restarted hostd has them again while their namespaces live
// (docs/containers.md).

// sourceRuntime is the Source of the guests added at run time.
const sourceRuntime = "runtime"

// runtimeGuests are the guests added at run time; mu serializes adds and
// removes and guards the maps.
type runtimeGuests struct {
	mu     sync.Mutex
	byName map[string]*runtimeGuest
	byNS   map[server.Netns]*runtimeGuest // by namespace: whom container_socket serves
	next   uint32                         // freeID looks from here: ids are not reused while hostd runs
}

type runtimeGuest struct {
	spec admin.GuestSpec
	ns   server.Netns
	g    *broker.Guest
}

// persisted is a run-time guest as state_dir/guests/NAME.json keeps it:
// the spec and its namespace's identity, so that a path that names
// another namespace after a restart (/proc/PID/ns/net, a reused pid) is
// not taken for the guest's.
type persisted struct {
	Spec admin.GuestSpec `json:"spec"`
	NS   server.Netns    `json:"ns"`
}

var guestName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// runtimeIDBase is where hostd starts looking for a free id for a guest
// added without one: above the ids people write in hostd.hcl.
const runtimeIDBase = 1 << 20

func (a *Agent) guestDir() string { return filepath.Join(a.cfg.StateDir, "guests") }

// buildRuntime checks spec and makes its guest (not yet registered
// anywhere); spec.ID must be set.
func (a *Agent) buildRuntime(spec admin.GuestSpec) (*runtimeGuest, error) {
	if !guestName.MatchString(spec.Name) || spec.Name[0] == '.' {
		return nil, fmt.Errorf("guest name %q: want 1 to 64 of A-Z a-z 0-9 _ . - (not starting with .)", spec.Name)
	}
	grp := a.groups[spec.Group]
	if grp == nil {
		return nil, fmt.Errorf("guest %s: trust group %q is not defined in %s", spec.Name, spec.Group, a.cfg.Path)
	}
	if spec.Netns == "" {
		return nil, fmt.Errorf("guest %s: give its network namespace (-netns /run/netns/NAME or /proc/PID/ns/net)", spec.Name)
	}
	ns, err := server.NetnsOf(spec.Netns)
	if err != nil {
		return nil, fmt.Errorf("guest %s: %w", spec.Name, err)
	}
	if self, err := server.NetnsOf("/proc/thread-self/ns/net"); err == nil && self == ns {
		return nil, fmt.Errorf("guest %s: %s is hostd's own network namespace: a guest needs one of its own", spec.Name, spec.Netns)
	}
	if spec.Control == "" && a.cfg.ContainerSocket == "" {
		return nil, fmt.Errorf("guest %s: hostd has no container_socket, so give the guest a control socket of its own (-control PATH)", spec.Name)
	}
	if spec.Control != "" && !filepath.IsAbs(spec.Control) {
		return nil, fmt.Errorf("guest %s: control %q: want an absolute path", spec.Name, spec.Control)
	}
	gc := config.Guest{Name: spec.Name, Interface: spec.Interface}
	for _, s := range spec.Addresses {
		ad, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("guest %s: address %q: %w", spec.Name, s, err)
		}
		gc.Addresses = append(gc.Addresses, ad.Unmap())
	}
	addrs, err := guestAddrs(a.cfg.ConntrackNetns, gc)
	if err != nil {
		return nil, err
	}
	if len(addrs.Prefixes) == 0 {
		return nil, fmt.Errorf("guest %s owns no addresses: give them (-addr), or an interface with routes to them", spec.Name)
	}
	g := &broker.Guest{Name: spec.Name, ID: spec.ID, Group: grp, Source: sourceRuntime}
	g.SetAddrs(addrs)
	return &runtimeGuest{spec: spec, ns: ns, g: g}, nil
}

// sameSpec reports whether an add repeats the guest's own spec (a CNI
// ADD retried): then it is no error.
func sameSpec(have, want admin.GuestSpec) bool {
	want.ID = have.ID
	if want.ID == 0 {
		return false
	}
	return have.Name == want.Name && have.Group == want.Group && have.Netns == want.Netns && have.Interface == want.Interface &&
		slices.Equal(have.Addresses, want.Addresses) && have.Control == want.Control && have.Container == want.Container
}

// freeID picks an id no guest has, from runtimeIDBase up and above those
// it gave before (a.rt.mu is held), so that logs and metrics never mix up
// a guest that went with a new one.
func (a *Agent) freeID() uint32 {
	used := map[uint32]bool{}
	for _, gi := range a.b.Guests() {
		used[gi.ID] = true
	}
	id := max(uint32(runtimeIDBase), a.rt.next)
	for used[id] {
		id++
	}
	a.rt.next = id + 1
	return id
}

// addRuntime adds a guest at run time: witness, mark id, broker, its
// control socket or its admission to container_socket, then its spec on
// disk. Anything that fails undoes the steps before it.
func (a *Agent) addRuntime(spec admin.GuestSpec) (admin.GuestReply, error) {
	a.rt.mu.Lock()
	defer a.rt.mu.Unlock()
	if r := a.rt.byName[spec.Name]; r != nil {
		if sameSpec(r.spec, spec) {
			return admin.GuestReply{Name: spec.Name, ID: r.g.ID}, nil
		}
		return admin.GuestReply{}, fmt.Errorf("guest %s exists with another spec (netns %s): remove it first (hostd guest remove %s)", spec.Name, r.spec.Netns, spec.Name)
	}
	if spec.ID == 0 {
		spec.ID = a.freeID()
	}
	r, err := a.buildRuntime(spec)
	if err != nil {
		return admin.GuestReply{}, err
	}
	for _, gc := range a.cfg.Guests {
		if ns, err := server.NetnsOf(gc.Netns); gc.Netns != "" && err == nil && ns == r.ns {
			return admin.GuestReply{}, fmt.Errorf("guest %s: network namespace %s is configured guest %s's: one namespace is one guest", spec.Name, spec.Netns, gc.Name)
		}
	}
	for _, o := range a.rt.byName {
		if o.ns == r.ns {
			return admin.GuestReply{}, fmt.Errorf("guest %s: network namespace %s (inode %d) is guest %s's already: one namespace is one guest", spec.Name, spec.Netns, r.ns.Ino, o.spec.Name)
		}
	}
	if err := a.registerRuntime(r); err != nil {
		return admin.GuestReply{}, err
	}
	if err := a.persist(r); err != nil {
		a.unregisterRuntime(r)
		return admin.GuestReply{}, err
	}
	a.log.Info("guest added", "guest", spec.Name, "id", spec.ID, "group", spec.Group, "netns", spec.Netns, "interface", spec.Interface,
		"addresses", r.g.Prefixes(), "container", spec.Container)
	return admin.GuestReply{Name: spec.Name, ID: spec.ID, Added: true}, nil
}

// registerRuntime gives r's guest its witness, mark id, broker entry and
// control path; a.rt.mu is held.
func (a *Agent) registerRuntime(r *runtimeGuest) error {
	g := r.g
	if a.witness != nil && r.spec.Interface != "" {
		var err error
		if g.Ifindex, err = attachWitness(a.witness, a.cfg.ConntrackNetns, r.spec.Interface); err != nil {
			return fmt.Errorf("guest %s: %w", g.Name, err)
		}
	}
	if err := a.markGuest(g, r.spec.Interface); err != nil {
		a.detachWitness(g)
		return fmt.Errorf("guest %s: %w", g.Name, err)
	}
	if err := a.b.AddGuest(g); err != nil {
		a.detachWitness(g)
		a.unmarkGuest(g)
		return err
	}
	a.rt.byName[g.Name], a.rt.byNS[r.ns] = r, r
	if err := a.serveOne(r); err != nil {
		a.unregisterRuntime(r)
		return err
	}
	return nil
}

// serveOne lets the control server serve run-time guest r: on the
// container socket, on the abstract socket in its namespace, and on its
// own socket if it has one, which takes only processes of its namespace.
func (a *Agent) serveOne(r *runtimeGuest) error {
	a.srv.Admit(r.g)
	if r.spec.Control != "" {
		return a.srv.Add(server.Endpoint{Guest: r.g, Path: r.spec.Control, Netns: r.spec.Netns})
	}
	if err := a.srv.AddNetns(r.g, r.spec.Netns); err != nil {
		// Best effort, as for configured guests: the container socket
		// serves it all the same.
		a.log.Warn("no control socket inside the guest's network namespace: its processes need the container socket", "guest", r.spec.Name, "error", err)
	}
	return nil
}

// unregisterRuntime takes r's guest away again: its sockets and sessions,
// its connections (their peers move to TCP, DOWN(peer-gone), and its
// rings and pair regions go back), its mark rule and witness; a.rt.mu is
// held.
func (a *Agent) unregisterRuntime(r *runtimeGuest) {
	delete(a.rt.byName, r.spec.Name)
	if a.rt.byNS[r.ns] == r {
		delete(a.rt.byNS, r.ns)
	}
	a.srv.Remove(r.g)
	a.b.RemoveGuest(r.g)
	a.detachWitness(r.g)
	a.unmarkGuest(r.g)
}

// removeRuntime removes the run-time guest called name, and its spec on
// disk. A guest that is not there is no error (Removed false): a CNI DEL
// may come twice, or after the guest's namespace went.
func (a *Agent) removeRuntime(name string) (admin.GuestReply, error) {
	a.rt.mu.Lock()
	defer a.rt.mu.Unlock()
	r := a.rt.byName[name]
	if r == nil {
		for _, gi := range a.b.Guests() {
			if gi.Name == name {
				return admin.GuestReply{}, fmt.Errorf("guest %s is a %s guest, not one added at run time: hostd guest remove takes away only those", name, gi.Source)
			}
		}
		return admin.GuestReply{Name: name}, nil
	}
	a.removeLocked(r)
	return admin.GuestReply{Name: name, ID: r.g.ID, Removed: true}, nil
}

// removeLocked removes run-time guest r and its spec on disk; a.rt.mu is
// held.
func (a *Agent) removeLocked(r *runtimeGuest) {
	a.unregisterRuntime(r)
	if err := os.Remove(filepath.Join(a.guestDir(), r.spec.Name+".json")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		a.log.Warn("cannot remove a removed guest's spec: a restarted hostd will find its namespace gone and drop it", "guest", r.spec.Name, "error", err)
	}
	a.log.Info("guest removed", "guest", r.spec.Name)
}

// listRuntime returns the run-time guests' specs, by name.
func (a *Agent) listRuntime() []admin.GuestSpec {
	a.rt.mu.Lock()
	defer a.rt.mu.Unlock()
	out := make([]admin.GuestSpec, 0, len(a.rt.byName))
	for _, r := range a.rt.byName {
		out = append(out, r.spec)
	}
	slices.SortFunc(out, func(x, y admin.GuestSpec) int {
		if x.Name < y.Name {
			return -1
		}
		if x.Name > y.Name {
			return 1
		}
		return 0
	})
	return out
}

// resolve names the guest of the process that connected to the container
// socket: the run-time guest of its network namespace.
func (a *Agent) resolve(c net.Conn) (*broker.Guest, error) {
	ns, cred, err := server.PeerNetns(c)
	if err != nil {
		return nil, err
	}
	a.rt.mu.Lock()
	defer a.rt.mu.Unlock()
	if r := a.rt.byNS[ns]; r != nil {
		return r.g, nil
	}
	return nil, fmt.Errorf("process %d is in network namespace %d, which is no guest's: hostd serves a container only once it is added (its CNI plugin, or hostd guest add)", cred.Pid, ns.Ino)
}

// persist writes r's spec to state_dir/guests/NAME.json (root-only, like
// the state directory), atomically.
func (a *Agent) persist(r *runtimeGuest) error {
	dir := a.guestDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("guest %s: keep its spec: %w", r.spec.Name, err)
	}
	b, err := json.Marshal(persisted{Spec: r.spec, NS: r.ns})
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+r.spec.Name+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("guest %s: keep its spec: %w", r.spec.Name, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, r.spec.Name+".json")); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("guest %s: keep its spec: %w", r.spec.Name, err)
	}
	return nil
}

// restoreRuntime reads the run-time guests an earlier hostd kept, before
// the broker exists, so that they are guests from the start like the
// configured ones (their flows are adopted too). A guest whose namespace
// went (or is another one now) is dropped with its file.
func (a *Agent) restoreRuntime() {
	a.rt.byName, a.rt.byNS = map[string]*runtimeGuest{}, map[server.Netns]*runtimeGuest{}
	ents, err := os.ReadDir(a.guestDir())
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			a.log.Warn("cannot read the run-time guests' specs; they are not restored", "dir", a.guestDir(), "error", err)
		}
		return
	}
	for _, e := range ents {
		if !e.Type().IsRegular() || filepath.Ext(e.Name()) != ".json" {
			continue
		}
		path := filepath.Join(a.guestDir(), e.Name())
		r, why := a.restoreOne(path)
		if r != nil && a.rt.byNS[r.ns] != nil {
			r, why = nil, "its namespace is guest "+a.rt.byNS[r.ns].spec.Name+"'s"
		}
		// A configured guest given its addresses meanwhile wins: a stale
		// spec must never keep hostd from starting (CheckOverlaps).
		if r != nil {
			if err := broker.CheckOverlaps(append(slices.Clone(a.guests), r.g)); err != nil {
				if a.witness != nil && r.g.Ifindex != 0 {
					a.witness.Detach(r.g.Ifindex)
				}
				r, why = nil, err.Error()
			}
		}
		if r == nil {
			a.log.Info("run-time guest not restored; its spec is dropped", "file", path, "why", why)
			_ = os.Remove(path)
			continue
		}
		a.guests = append(a.guests, r.g)
		a.rt.byName[r.spec.Name], a.rt.byNS[r.ns] = r, r
	}
}

func (a *Agent) restoreOne(path string) (*runtimeGuest, string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err.Error()
	}
	var p persisted
	if err := json.Unmarshal(b, &p); err != nil {
		return nil, err.Error()
	}
	if p.Spec.Name+".json" != filepath.Base(path) || p.Spec.ID == 0 {
		return nil, "the file is not a guest's spec"
	}
	for _, g := range a.guests {
		if g.Name == p.Spec.Name || g.ID == p.Spec.ID {
			return nil, fmt.Sprintf("guest %s (id %d) clashes with guest %s (id %d) of %s", p.Spec.Name, p.Spec.ID, g.Name, g.ID, g.Source)
		}
	}
	r, err := a.buildRuntime(p.Spec)
	if err != nil {
		return nil, err.Error()
	}
	if r.ns != p.NS {
		return nil, fmt.Sprintf("%s is now namespace %d, not the guest's %d: the guest is gone", p.Spec.Netns, r.ns.Ino, p.NS.Ino)
	}
	if a.witness != nil && p.Spec.Interface != "" {
		if r.g.Ifindex, err = attachWitness(a.witness, a.cfg.ConntrackNetns, p.Spec.Interface); err != nil {
			return nil, err.Error()
		}
	}
	return r, ""
}

// serveRuntime serves the restored run-time guests once the control
// server runs: their own sockets, or their admission to container_socket,
// which it opens.
func (a *Agent) serveRuntime() error {
	a.rt.mu.Lock()
	defer a.rt.mu.Unlock()
	for _, r := range a.rt.byName {
		if err := a.serveOne(r); err != nil {
			return err
		}
	}
	if a.cfg.ContainerSocket == "" {
		return nil
	}
	return a.srv.AddShared(a.cfg.ContainerSocket, a.resolve)
}

// reapInterval is how often hostd looks for run-time guests whose
// namespace went without a remove (a runtime that crashed before its CNI
// DEL).
const reapInterval = 5 * time.Second

// reapRuntime removes run-time guests whose network namespace is gone or
// is another one now, until ctx ends.
func (a *Agent) reapRuntime(ctx context.Context) {
	defer a.wg.Done()
	t := time.NewTicker(reapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.rt.mu.Lock()
		for _, r := range a.rt.byName {
			if ns, err := server.NetnsOf(r.spec.Netns); err == nil && ns == r.ns {
				continue
			}
			a.log.Info("run-time guest's network namespace is gone; removing the guest", "guest", r.spec.Name, "netns", r.spec.Netns)
			a.removeLocked(r)
		}
		a.rt.mu.Unlock()
	}
}
