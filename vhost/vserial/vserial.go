// Package vserial gives a VM its control channel to hostd as a
// virtio-serial port named org.shunt.ctl, bound to a Unix socket that hostd
// listens on (one per VM: the channel is the guest's identity), and finds
// the port from inside the guest.
//
// Both ends of a virtio-serial port drop data until both are open, so the
// guest says HELLO until hostd answers WELCOME, and QEMU reconnects to the
// socket when hostd restarts.
package vserial

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Name is the port name guests look for.
const Name = "org.shunt.ctl"

// Port describes a VM's control port.
type Port struct {
	ID     string // QEMU id suffix, e.g. "shunt0"
	Socket string // hostd's Unix socket for this VM (the guest's control in hostd.hcl)
}

func (p Port) check() error {
	if p.ID == "" || strings.ContainsAny(p.ID, ", =") {
		return fmt.Errorf("port id %q: want a plain name", p.ID)
	}
	if !filepath.IsAbs(p.Socket) || strings.ContainsAny(p.Socket, ",") {
		return fmt.Errorf("port socket %q: want an absolute path without commas", p.Socket)
	}
	return nil
}

// QEMUArgs returns the arguments for the port: QEMU connects to hostd's
// socket and reconnects every second while hostd is away.
func (p Port) QEMUArgs() ([]string, error) {
	if err := p.check(); err != nil {
		return nil, err
	}
	return []string{
		"-chardev", fmt.Sprintf("socket,id=chr-%s,path=%s,reconnect=1", p.ID, p.Socket),
		"-device", fmt.Sprintf("virtio-serial-pci,id=vser-%s", p.ID),
		"-device", fmt.Sprintf("virtserialport,bus=vser-%s.0,chardev=chr-%s,name=%s", p.ID, p.ID, Name),
	}, nil
}

// LibvirtXML returns the domain's <channel> element.
func (p Port) LibvirtXML() (string, error) {
	if err := p.check(); err != nil {
		return "", err
	}
	return fmt.Sprintf("<channel type='unix'>\n  <source mode='connect' path='%s'>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  <target type='virtio' name='%s'/>\n</channel>", p.Socket, Name), nil
}

// ErrNotFound means the guest has no Shunt control port.
var ErrNotFound = errors.New("no virtio-serial port named " + Name + " in this guest")

// Find returns the character device of the port named Name: the udev link
// under dev/virtio-ports if there is one, else /dev/vportNpM found by name
// under sysfs class/virtio-ports (guests without udev).
func Find(sysfs, dev string) (string, error) {
	link := filepath.Join(dev, "virtio-ports", Name)
	if _, err := os.Stat(link); err == nil {
		return link, nil
	}
	ports, _ := filepath.Glob(filepath.Join(sysfs, "class/virtio-ports/vport*"))
	for _, p := range ports {
		b, err := os.ReadFile(filepath.Join(p, "name"))
		if err == nil && strings.TrimSpace(string(b)) == Name {
			return filepath.Join(dev, filepath.Base(p)), nil
		}
	}
	return "", ErrNotFound
}
