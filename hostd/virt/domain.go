package virt

import (
	"encoding/xml"
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"

	"github.com/shuntnet/shunt/vhost/vserial"
)

// Namespace is the XML namespace of Shunt's domain metadata.
const Namespace = "https://github.com/shuntnet/shunt/xmlns/guest/1"

// ErrNotShunt means a domain has neither a Shunt channel nor Shunt
// metadata: it is none of hostd's business.
var ErrNotShunt = errors.New("not a Shunt domain")

// Domain is what hostd needs to know of a running Shunt domain. A plain
// value; Equal compares two.
type Domain struct {
	Name      string
	UUID      string
	ID        uint32       // guest id: from metadata, else derived from the UUID
	Group     string       // trust group named in metadata; "" to go by Shmem
	Shmem     []string     // names of its ivshmem devices (/dev/shm/<name>), hostd's pair regions aside
	Controls  []string     // the sockets of its org.shunt.ctl[.N] channels, port 0 first
	Tap       string       // host-side device of its first interface ("" before it runs)
	Addresses []netip.Addr // addresses named in metadata
	CTMark    uint32
}

// Equal reports whether two descriptions are the same.
func (d Domain) Equal(o Domain) bool {
	return d.Name == o.Name && d.UUID == o.UUID && d.ID == o.ID && d.Group == o.Group &&
		slices.Equal(d.Shmem, o.Shmem) && slices.Equal(d.Controls, o.Controls) && d.Tap == o.Tap &&
		slices.Equal(d.Addresses, o.Addresses) && d.CTMark == o.CTMark
}

// Metadata is Shunt's element in a domain's <metadata>.
type Metadata struct {
	XMLName   xml.Name `xml:"https://github.com/shuntnet/shunt/xmlns/guest/1 guest"`
	ID        *uint32  `xml:"id,omitempty"`
	Group     string   `xml:"group,omitempty"`
	Addresses []string `xml:"address,omitempty"`
	CTMark    uint32   `xml:"ct-mark,omitempty"`
}

// XML renders the metadata element with the "shunt" prefix, as it goes into
// a domain definition.
func (m Metadata) XML() string {
	var b strings.Builder
	fmt.Fprintf(&b, "<shunt:guest xmlns:shunt=%q>\n", Namespace)
	if m.ID != nil {
		fmt.Fprintf(&b, "  <shunt:id>%d</shunt:id>\n", *m.ID)
	}
	if m.Group != "" {
		fmt.Fprintf(&b, "  <shunt:group>%s</shunt:group>\n", escape(m.Group))
	}
	for _, a := range m.Addresses {
		fmt.Fprintf(&b, "  <shunt:address>%s</shunt:address>\n", escape(a))
	}
	if m.CTMark != 0 {
		fmt.Fprintf(&b, "  <shunt:ct-mark>%d</shunt:ct-mark>\n", m.CTMark)
	}
	b.WriteString("</shunt:guest>")
	return b.String()
}

func escape(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}

type domainXML struct {
	Name     string `xml:"name"`
	UUID     string `xml:"uuid"`
	Metadata struct {
		Guest []Metadata `xml:"https://github.com/shuntnet/shunt/xmlns/guest/1 guest"`
	} `xml:"metadata"`
	Devices struct {
		Interfaces []struct {
			Target struct {
				Dev string `xml:"dev,attr"`
			} `xml:"target"`
		} `xml:"interface"`
		Shmems []struct {
			Name  string `xml:"name,attr"`
			Model struct {
				Type string `xml:"type,attr"`
			} `xml:"model"`
		} `xml:"shmem"`
		Channels []struct {
			Type   string `xml:"type,attr"`
			Source struct {
				Mode string `xml:"mode,attr"`
				Path string `xml:"path,attr"`
			} `xml:"source"`
			Target struct {
				Type string `xml:"type,attr"`
				Name string `xml:"name,attr"`
			} `xml:"target"`
		} `xml:"channel"`
	} `xml:"devices"`
}

// ParseDomain reads what hostd needs from a domain's XML (the live XML, for
// the tap). It returns ErrNotShunt for other domains, and an error that
// says what to fix for a Shunt domain described wrongly.
func ParseDomain(src []byte) (Domain, error) {
	var x domainXML
	if err := xml.Unmarshal(src, &x); err != nil {
		return Domain{}, fmt.Errorf("parse domain XML: %w", err)
	}
	d := Domain{Name: x.Name, UUID: strings.ToLower(x.UUID)}
	ctl := map[int]string{}
	for _, c := range x.Devices.Channels {
		i, ok := vserial.IndexOf(c.Target.Name)
		if !ok {
			continue
		}
		name := c.Target.Name
		switch {
		case c.Type != "unix" || c.Target.Type != "virtio":
			return d, fmt.Errorf("domain %s: channel %s is type %q target %q, want type='unix' with target type='virtio'", d.Name, name, c.Type, c.Target.Type)
		case c.Source.Mode != "connect":
			return d, fmt.Errorf("domain %s: channel %s has source mode %q, want mode='connect' (hostd listens, QEMU connects and reconnects)", d.Name, name, c.Source.Mode)
		case !filepath.IsAbs(c.Source.Path):
			return d, fmt.Errorf("domain %s: channel %s path %q is not absolute", d.Name, name, c.Source.Path)
		}
		if _, dup := ctl[i]; dup {
			return d, fmt.Errorf("domain %s has two channels named %s, want one", d.Name, name)
		}
		ctl[i] = filepath.Clean(c.Source.Path)
	}
	metas := x.Metadata.Guest
	if len(ctl) == 0 && len(metas) == 0 {
		return d, ErrNotShunt
	}
	if d.Name == "" {
		return d, errors.New("domain XML has no <name>")
	}
	switch {
	case len(ctl) == 0:
		return d, fmt.Errorf("domain %s has Shunt metadata but no <channel> with target name %s", d.Name, vserial.Name)
	case len(metas) > 1:
		return d, fmt.Errorf("domain %s has %d Shunt metadata elements, want at most one", d.Name, len(metas))
	}
	for i := range len(ctl) {
		p, ok := ctl[i]
		if !ok {
			return d, fmt.Errorf("domain %s has %d Shunt channels but none named %s: number them from %s up", d.Name, len(ctl), vserial.PortName(i), vserial.Name)
		}
		d.Controls = append(d.Controls, p)
	}
	if len(slices.Compact(slices.Sorted(slices.Values(d.Controls)))) != len(d.Controls) {
		return d, fmt.Errorf("domain %s: two Shunt channels share a socket path", d.Name)
	}
	for _, s := range x.Devices.Shmems {
		// hostd's pair regions come and go while the domain runs: they
		// are not part of its description (Equal would see a change).
		if (s.Model.Type == "ivshmem-plain" || s.Model.Type == "ivshmem-doorbell") && !strings.HasPrefix(s.Name, PairShmemPrefix) {
			d.Shmem = append(d.Shmem, s.Name)
		}
	}
	if len(x.Devices.Interfaces) > 0 {
		d.Tap = x.Devices.Interfaces[0].Target.Dev
	}
	if len(metas) == 1 {
		m := metas[0]
		d.Group, d.CTMark = strings.TrimSpace(m.Group), m.CTMark
		if m.ID != nil {
			if *m.ID == 0 {
				return d, fmt.Errorf("domain %s: Shunt metadata id 0: want 1 or more", d.Name)
			}
			d.ID = *m.ID
		}
		for _, s := range m.Addresses {
			a, err := netip.ParseAddr(strings.TrimSpace(s))
			if err != nil {
				return d, fmt.Errorf("domain %s: Shunt metadata address: %w", d.Name, err)
			}
			d.Addresses = append(d.Addresses, a.Unmap())
		}
	}
	if len(d.Shmem) == 0 && d.Group == "" {
		return d, fmt.Errorf("domain %s has a %s channel but no ivshmem <shmem> device for its trust group's region, and its Shunt metadata names no trust group (<shunt:group>, for a group with vm_regions = \"pair\", whose domains have no <shmem>)", d.Name, vserial.Name)
	}
	if d.ID == 0 {
		if d.UUID == "" {
			return d, fmt.Errorf("domain %s has neither a Shunt metadata id nor a <uuid>", d.Name)
		}
		d.ID = IDFromUUID(d.UUID)
	}
	return d, nil
}

// IDFromUUID is the guest id of a domain whose metadata names none: stable
// across restarts of the domain and of hostd, with the top bit set so it
// stays clear of the small ids operators write in hostd.hcl.
func IDFromUUID(uuid string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(strings.ToLower(uuid)))
	return h.Sum32() | 1<<31
}
