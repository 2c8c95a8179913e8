package virt_test

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/virt"
)

// domainXML is a live domain as libvirt 9 prints it, trimmed.
func domainXML(name, meta, channel string) string {
	return fmt.Sprintf(`<domain type='qemu' id='3'>
  <name>%s</name>
  <uuid>6F1C2B0A-0C9E-4E3C-9C44-0D1B2E3F4A5B</uuid>
  <metadata>%s</metadata>
  <devices>
    <interface type='ethernet'>
      <mac address='52:54:00:9d:c4:f8'/>
      <target dev='shlv1'/>
      <model type='virtio'/>
    </interface>
    %s
    <shmem name='shunt-t'>
      <model type='ivshmem-plain'/>
      <size unit='M'>32</size>
    </shmem>
  </devices>
</domain>`, name, meta, channel)
}

const channel = `<channel type='unix'>
      <source mode='connect' path='/run/shunt/vm1.sock'><reconnect enabled='yes' timeout='1'/></source>
      <target type='virtio' name='org.shunt.ctl'/>
    </channel>`

func TestParseDomain(t *testing.T) {
	id := uint32(101)
	meta := virt.Metadata{ID: &id, Group: "t", Addresses: []string{"10.77.101.2", "fd00::2"}, CTMark: 7}.XML()
	d, err := virt.ParseDomain([]byte(domainXML("vm1", meta, channel)))
	if err != nil {
		t.Fatal(err)
	}
	want := virt.Domain{Name: "vm1", UUID: "6f1c2b0a-0c9e-4e3c-9c44-0d1b2e3f4a5b", ID: 101, Group: "t", Shmem: []string{"shunt-t"},
		Controls: []string{"/run/shunt/vm1.sock"}, Tap: "shlv1", CTMark: 7,
		Addresses: []netip.Addr{netip.MustParseAddr("10.77.101.2"), netip.MustParseAddr("fd00::2")}}
	if !d.Equal(want) {
		t.Fatalf("got %+v\nwant %+v", d, want)
	}
}

func TestParseDomainWithoutMetadataDerivesID(t *testing.T) {
	d, err := virt.ParseDomain([]byte(domainXML("vm1", "", channel)))
	if err != nil {
		t.Fatal(err)
	}
	if d.ID != virt.IDFromUUID("6f1c2b0a-0c9e-4e3c-9c44-0d1b2e3f4a5b") || d.ID&(1<<31) == 0 {
		t.Fatalf("id %#x", d.ID)
	}
	if d.ID != virt.IDFromUUID("6F1C2B0A-0C9E-4E3C-9C44-0D1B2E3F4A5B") {
		t.Fatal("id depends on the UUID's case")
	}
}

func TestParseDomainNotShunt(t *testing.T) {
	_, err := virt.ParseDomain([]byte(domainXML("web", "<app:x xmlns:app='urn:app'/>", "")))
	if !errors.Is(err, virt.ErrNotShunt) {
		t.Fatalf("err = %v, want ErrNotShunt", err)
	}
}

func TestParseDomainErrorsSayWhatToFix(t *testing.T) {
	meta := virt.Metadata{Group: "t"}.XML()
	zero := uint32(0)
	tests := []struct{ name, xml, want string }{
		{"metadata without channel", domainXML("vm1", meta, ""), "no <channel> with target name org.shunt.ctl"},
		{"bind mode", domainXML("vm1", "", strings.Replace(channel, "mode='connect'", "mode='bind'", 1)), "want mode='connect'"},
		{"relative path", domainXML("vm1", "", strings.Replace(channel, "/run/shunt/vm1.sock", "vm1.sock", 1)), "is not absolute"},
		{"pty channel", domainXML("vm1", "", strings.Replace(channel, "type='unix'", "type='pty'", 1)), "want type='unix'"},
		{"two channels", domainXML("vm1", "", channel+channel), "two channels named org.shunt.ctl"},
		{"bad address", domainXML("vm1", virt.Metadata{Addresses: []string{"10.1"}}.XML(), channel), "metadata address"},
		{"id zero", domainXML("vm1", virt.Metadata{ID: &zero}.XML(), channel), "id 0"},
		{"no shmem", strings.Replace(domainXML("vm1", "", channel), "ivshmem-plain", "none", 1), "no ivshmem <shmem> device"},
		{"not XML", "<domain><name>x", "parse domain XML"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := virt.ParseDomain([]byte(tt.xml))
			if err == nil || errors.Is(err, virt.ErrNotShunt) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestMetadataXMLEscapes(t *testing.T) {
	x := virt.Metadata{Group: "a<b&c"}.XML()
	d, err := virt.ParseDomain([]byte(domainXML("vm1", x, channel)))
	if err != nil {
		t.Fatal(err)
	}
	if d.Group != "a<b&c" {
		t.Fatalf("group %q from %s", d.Group, x)
	}
}

// FuzzParseDomain: any input gives a domain or an error, never a panic,
// and a domain it accepts has what registration relies on.
func FuzzParseDomain(f *testing.F) {
	id := uint32(5)
	f.Add([]byte(domainXML("vm1", virt.Metadata{ID: &id, Group: "t", Addresses: []string{"10.0.0.1"}}.XML(), channel)))
	f.Add([]byte(domainXML("vm1", "", channel)))
	f.Add([]byte(domainXML("web", "", "")))
	f.Add([]byte("<domain/>"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := virt.ParseDomain(b)
		if err != nil {
			return
		}
		if d.Name == "" || d.ID == 0 || len(d.Controls) == 0 || !strings.HasPrefix(d.Controls[0], "/") || len(d.Shmem) == 0 {
			t.Fatalf("accepted an incomplete domain: %+v", d)
		}
	})
}

func TestParseDomainSeveralPorts(t *testing.T) {
	port := func(name, path string) string {
		return fmt.Sprintf("<channel type='unix'><source mode='connect' path='%s'/><target type='virtio' name='%s'/></channel>", path, name)
	}
	x := domainXML("vm1", "", port("org.shunt.ctl.1", "/run/shunt/vm1.sock.1")+port("org.shunt.ctl", "/run/shunt/vm1.sock")+
		port("org.qemu.guest_agent.0", "/run/qga.sock"))
	d, err := virt.ParseDomain([]byte(x))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(d.Controls, " ") != "/run/shunt/vm1.sock /run/shunt/vm1.sock.1" {
		t.Fatalf("controls %v, want port 0 then port 1", d.Controls)
	}
	gap := domainXML("vm1", "", port("org.shunt.ctl", "/a")+port("org.shunt.ctl.2", "/b"))
	if _, err := virt.ParseDomain([]byte(gap)); err == nil || !strings.Contains(err.Error(), "none named org.shunt.ctl.1") {
		t.Fatalf("a gap in the port numbers: %v", err)
	}
	shared := domainXML("vm1", "", port("org.shunt.ctl", "/a")+port("org.shunt.ctl.1", "/a"))
	if _, err := virt.ParseDomain([]byte(shared)); err == nil || !strings.Contains(err.Error(), "share a socket path") {
		t.Fatalf("two ports on one socket: %v", err)
	}
}
