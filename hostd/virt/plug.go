package virt

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket/dialers"
)

// PairShmemPrefix begins the <shmem> names of hostd's pair regions for
// libvirt domains: region id of guests a and b is /dev/shm/PairShmem(a,
// b, id), a name hostd keeps for itself (hostd/config refuses a trust
// group region by it). ParseDomain leaves such devices out of a Domain:
// hostd plugs and unplugs them while the domain runs, which is no change
// of the domain.
const PairShmemPrefix = "shunt-pair-"

// PairShmem is the <shmem> name (the file in /dev/shm) of region id of
// guests a and b, a the lower id: "shunt-pair-A-B-pID". Each region of a
// pair has a name of its own, so that the unplug of a pair's old region
// and the plug of its next one never touch each other's device or file.
func PairShmem(a, b, id uint32) string { return fmt.Sprintf("%sp%d", PairOf(a, b), id) }

// PairOf is what the names of every region of guests a and b begin with.
func PairOf(a, b uint32) string { return fmt.Sprintf("%s%d-%d-", PairShmemPrefix, a, b) }

// Shmem is an ivshmem-plain <shmem> device: libvirt backs it with the file
// /dev/shm/<Name> (a memory-backend-file with share=on), which must exist
// before it is plugged (hostd creates it). Alias is libvirt's name for
// the device in the domain ("ua-..." when the user chose it).
type Shmem struct {
	Name  string
	Alias string
	Size  int64 // bytes: a power of two, at least 1 MiB
}

// XML renders the device as DomainAttachDeviceFlags takes it, in MiB
// (libvirt's "M"), with the alias as a user alias.
func (s Shmem) XML() string {
	var b strings.Builder
	fmt.Fprintf(&b, "<shmem name='%s'>\n  <model type='ivshmem-plain'/>\n  <size unit='M'>%d</size>\n", escape(s.Name), s.Size>>20)
	if s.Alias != "" {
		fmt.Fprintf(&b, "  <alias name='%s'/>\n", escape(s.Alias))
	}
	b.WriteString("</shmem>")
	return b.String()
}

// UserAlias is the alias libvirt accepts from a user for a device: "ua-"
// and the id.
func UserAlias(id string) string { return "ua-" + id }

// Shmems returns the <shmem> devices in a domain's live XML, in order.
func Shmems(domXML []byte) ([]Shmem, error) {
	var x struct {
		Devices struct {
			Shmems []struct {
				Name  string `xml:"name,attr"`
				Model struct {
					Type string `xml:"type,attr"`
				} `xml:"model"`
				Size struct {
					Unit  string `xml:"unit,attr"`
					Value int64  `xml:",chardata"`
				} `xml:"size"`
				Alias struct {
					Name string `xml:"name,attr"`
				} `xml:"alias"`
			} `xml:"shmem"`
		} `xml:"devices"`
	}
	if err := xml.Unmarshal(domXML, &x); err != nil {
		return nil, fmt.Errorf("parse domain XML: %w", err)
	}
	var out []Shmem
	for _, s := range x.Devices.Shmems {
		size := s.Size.Value
		switch s.Size.Unit {
		case "", "b", "bytes":
		case "K", "KiB", "k":
			size <<= 10
		case "M", "MiB":
			size <<= 20
		case "G", "GiB":
			size <<= 30
		}
		out = append(out, Shmem{Name: s.Name, Alias: s.Alias.Name, Size: size})
	}
	return out, nil
}

// API is the part of go-libvirt's client that Plugger uses
// (*libvirt.Libvirt); unit tests give a fake.
type API interface {
	DomainLookupByName(name string) (libvirt.Domain, error)
	DomainGetXMLDesc(d libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error)
	DomainAttachDeviceFlags(d libvirt.Domain, xml string, flags uint32) error
	DomainDetachDeviceAlias(d libvirt.Domain, alias string, flags uint32) error
}

// ErrDomainGone means the domain is not running (undefined, or shut off):
// it has no devices to plug into.
var ErrDomainGone = errors.New("libvirt domain not running")

// Plugger plugs <shmem> devices into running domains and takes them out
// again, over a libvirtd connection of its own (not the Watcher's), made
// at the first call and made again once libvirtd dropped it. Safe for
// concurrent use; Close ends the connection.
type Plugger struct {
	dial func() (API, <-chan struct{}, func() error, error)
	poll time.Duration

	mu     sync.Mutex
	api    API
	gone   <-chan struct{} // closed when api's connection ended
	closer func() error
}

// NewPlugger returns a Plugger that reaches libvirtd at socket and opens
// uri (as Dial).
func NewPlugger(socket, uri string) *Plugger {
	return NewPluggerAPI(func() (API, <-chan struct{}, func() error, error) {
		l := libvirt.NewWithDialer(dialers.NewLocal(dialers.WithSocket(socket), dialers.WithLocalTimeout(5*time.Second)))
		if err := l.ConnectToURI(libvirt.ConnectURI(uri)); err != nil {
			return nil, nil, nil, fmt.Errorf("connect to libvirtd at %s (%s): %w; is libvirtd running?", socket, uri, err)
		}
		return l, l.Disconnected(), l.Disconnect, nil
	})
}

// NewPluggerAPI returns a Plugger over connections that dial makes: the
// API, a channel closed when the connection ends (nil: never), and how to
// close it.
func NewPluggerAPI(dial func() (API, <-chan struct{}, func() error, error)) *Plugger {
	return &Plugger{dial: dial, poll: 20 * time.Millisecond}
}

// conn returns the current connection, dialing if there is none or it
// ended.
func (p *Plugger) conn() (API, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.api != nil {
		select {
		case <-p.gone:
			_ = p.closer()
			p.api = nil
		default:
			return p.api, nil
		}
	}
	api, gone, closer, err := p.dial()
	if err != nil {
		return nil, err
	}
	p.api, p.gone, p.closer = api, gone, closer
	return api, nil
}

// Close ends the connection, if there is one.
func (p *Plugger) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.api == nil {
		return nil
	}
	p.api = nil
	return p.closer()
}

// domain looks up a running domain: ErrDomainGone if it is not.
func domain(api API, name string) (libvirt.Domain, error) {
	d, err := api.DomainLookupByName(name)
	if libvirt.IsNotFound(err) {
		return d, fmt.Errorf("domain %s: %w", name, ErrDomainGone)
	}
	if err != nil {
		return d, fmt.Errorf("look up domain %s: %w", name, err)
	}
	return d, nil
}

// gone reports whether a libvirt error says that the domain is not there
// or not running (VIR_ERR_NO_DOMAIN, VIR_ERR_OPERATION_INVALID: "domain is
// not running").
func gone(err error) bool {
	var e libvirt.Error
	return libvirt.IsNotFound(err) || errors.As(err, &e) && e.Code == uint32(libvirt.ErrOperationInvalid) && strings.Contains(e.Message, "not running")
}

// live returns the shmem devices of running domain d.
func live(api API, d libvirt.Domain) ([]Shmem, error) {
	x, err := api.DomainGetXMLDesc(d, 0)
	if err != nil {
		if gone(err) {
			return nil, fmt.Errorf("domain %s: %w", d.Name, ErrDomainGone)
		}
		return nil, fmt.Errorf("XML of domain %s: %w", d.Name, err)
	}
	return Shmems([]byte(x))
}

// Attach plugs s into the running domain dom (VIR_DOMAIN_AFFECT_LIVE: the
// domain's persistent definition keeps no trace) and returns once libvirt
// added it (QEMU's device_add answered); the guest then finds it through
// its ACPI hot-plug. A domain that is not running is ErrDomainGone.
func (p *Plugger) Attach(ctx context.Context, dom string, s Shmem) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	api, err := p.conn()
	if err != nil {
		return err
	}
	d, err := domain(api, dom)
	if err != nil {
		return err
	}
	if err := api.DomainAttachDeviceFlags(d, s.XML(), uint32(libvirt.DomainAffectLive)); err != nil {
		if gone(err) {
			return fmt.Errorf("domain %s: %w", dom, ErrDomainGone)
		}
		return fmt.Errorf("attach <shmem name='%s'> to domain %s: %w", s.Name, dom, err)
	}
	return nil
}

// Detach takes every <shmem> device whose name which accepts out of
// running domain dom, each by its alias (so one that an earlier hostd
// plugged goes too), and waits until the domain's live XML no longer
// lists them: libvirt's detach by alias only asks QEMU, whose device goes
// once the guest ejected it. It returns how many it took out. A domain
// that is not running, or has no such device, is not an error; ctx bounds
// the wait.
func (p *Plugger) Detach(ctx context.Context, dom string, which func(name string) bool) (int, error) {
	api, err := p.conn()
	if err != nil {
		return 0, err
	}
	d, err := domain(api, dom)
	if errors.Is(err, ErrDomainGone) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	named := func() ([]Shmem, error) {
		all, err := live(api, d)
		var out []Shmem
		for _, s := range all {
			if which(s.Name) {
				out = append(out, s)
			}
		}
		return out, err
	}
	devs, err := named()
	if errors.Is(err, ErrDomainGone) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	for _, s := range devs {
		if s.Alias == "" {
			return 0, fmt.Errorf("domain %s: <shmem name='%s'> has no alias to detach it by", dom, s.Name)
		}
		err := api.DomainDetachDeviceAlias(d, s.Alias, uint32(libvirt.DomainAffectLive))
		if gone(err) {
			return 0, nil
		}
		// A detach already under way (hostd restarted in the middle of
		// one) is answered as an error by some libvirt versions; the
		// wait below decides.
		if err != nil && !strings.Contains(err.Error(), "already in the process of unplug") {
			return 0, fmt.Errorf("detach %s (<shmem name='%s'>) from domain %s: %w", s.Alias, s.Name, dom, err)
		}
	}
	for {
		left, err := named()
		if errors.Is(err, ErrDomainGone) || err == nil && len(left) == 0 {
			return len(devs), nil
		}
		if err != nil {
			return 0, err
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("domain %s still has <shmem name='%s'> (alias %s): the guest did not eject it: %w", dom, left[0].Name, left[0].Alias, ctx.Err())
		case <-time.After(p.poll):
		}
	}
}
