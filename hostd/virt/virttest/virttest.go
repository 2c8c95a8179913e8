// Package virttest is a fake libvirtd for the tests of hostd/virt's
// Plugger and its users: running domains whose devices are <shmem>
// elements. The integration test (integration/libvirt_test.go) runs the
// real one.
package virttest

import (
	"fmt"
	"strings"
	"sync"

	"github.com/digitalocean/go-libvirt"

	"github.com/shuntnet/shunt/hostd/virt"
)

// Libvirt implements virt.API: attach adds a device (with a PCI address,
// as libvirt's live XML has it), detach by alias marks it, and it goes
// after EjectAfter more XML reads (the guest's eject). Safe for
// concurrent use.
type Libvirt struct {
	mu         sync.Mutex
	doms       map[string][]virt.Shmem // running domains
	detaching  map[string]int          // alias -> XML reads left
	EjectAfter int                     // -1: the guest never ejects; set before use
	Calls      []string                // "attach DOM flags=N", "detach DOM ALIAS flags=N"
}

// New returns a libvirtd running domains doms, with no devices; a detached
// device goes after two XML reads.
func New(doms ...string) *Libvirt {
	f := &Libvirt{doms: map[string][]virt.Shmem{}, detaching: map[string]int{}, EjectAfter: 2}
	for _, d := range doms {
		f.doms[d] = nil
	}
	return f
}

// Plugger returns a Plugger over f.
func (f *Libvirt) Plugger() *virt.Plugger {
	return virt.NewPluggerAPI(func() (virt.API, <-chan struct{}, func() error, error) {
		return f, nil, func() error { return nil }, nil
	})
}

// ErrNoDomain is libvirt's answer for a domain that is not there.
var ErrNoDomain = libvirt.Error{Code: uint32(libvirt.ErrNoDomain), Message: "Domain not found"}

// Stop makes domain name not running.
func (f *Libvirt) Stop(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.doms, name)
}

// Devices returns domain dom's devices.
func (f *Libvirt) Devices(dom string) []virt.Shmem {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]virt.Shmem(nil), f.doms[dom]...)
}

// CallLog returns the attach and detach calls so far.
func (f *Libvirt) CallLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.Calls...)
}

func (f *Libvirt) DomainLookupByName(name string) (libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.doms[name]; !ok {
		return libvirt.Domain{}, ErrNoDomain
	}
	return libvirt.Domain{Name: name}, nil
}

func (f *Libvirt) DomainGetXMLDesc(d libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	devs, ok := f.doms[d.Name]
	if !ok {
		return "", ErrNoDomain
	}
	var b strings.Builder
	fmt.Fprintf(&b, "<domain type='qemu' id='1'><name>%s</name><devices>", d.Name)
	var kept []virt.Shmem
	for _, s := range devs {
		if n, ok := f.detaching[s.Alias]; ok && n == 0 {
			delete(f.detaching, s.Alias)
			continue // ejected
		} else if ok && n > 0 {
			f.detaching[s.Alias] = n - 1
		}
		kept = append(kept, s)
		b.WriteString(strings.Replace(s.XML(), "</shmem>", "  <address type='pci' domain='0x0000' bus='0x00' slot='0x05' function='0x0'/>\n</shmem>", 1))
	}
	f.doms[d.Name] = kept
	b.WriteString("</devices></domain>")
	return b.String(), nil
}

func (f *Libvirt) DomainAttachDeviceFlags(d libvirt.Domain, x string, flags uint32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls = append(f.Calls, fmt.Sprintf("attach %s flags=%d", d.Name, flags))
	if _, ok := f.doms[d.Name]; !ok {
		return ErrNoDomain
	}
	s, err := virt.Shmems([]byte("<domain><devices>" + x + "</devices></domain>"))
	if err != nil || len(s) != 1 {
		return fmt.Errorf("bad device XML %q: %v", x, err)
	}
	f.doms[d.Name] = append(f.doms[d.Name], s[0])
	return nil
}

func (f *Libvirt) DomainDetachDeviceAlias(d libvirt.Domain, alias string, flags uint32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls = append(f.Calls, fmt.Sprintf("detach %s %s flags=%d", d.Name, alias, flags))
	if _, ok := f.doms[d.Name]; !ok {
		return ErrNoDomain
	}
	for _, s := range f.doms[d.Name] {
		if s.Alias == alias {
			if f.EjectAfter >= 0 {
				f.detaching[alias] = f.EjectAfter
			}
			return nil
		}
	}
	return fmt.Errorf("no device found with alias %s", alias)
}
