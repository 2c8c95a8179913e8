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
	"sort"
	"strconv"
	"strings"
)

// Name is the port name guests look for.
const Name = "org.shunt.ctl"

// Port describes a VM's control ports.
type Port struct {
	ID     string // QEMU id suffix, e.g. "shunt0"
	Socket string // hostd's Unix socket for this VM (the guest's control in hostd.hcl)
	// Ports is how many ports the VM gets (0 means 1): a port has one
	// user at a time, so a VM gets one per process that uses Shunt at
	// once (MPI ranks). Port i is named PortName(i) and connects to
	// SocketOf(i).
	Ports int
}

// Count returns the number of ports.
func (p Port) Count() int { return max(p.Ports, 1) }

// PortName is the name of port i: Name, then Name.1, Name.2, ...
func PortName(i int) string {
	if i == 0 {
		return Name
	}
	return fmt.Sprintf("%s.%d", Name, i)
}

// IndexOf is PortName's inverse; ok is false for other names.
func IndexOf(name string) (int, bool) {
	if name == Name {
		return 0, true
	}
	rest, ok := strings.CutPrefix(name, Name+".")
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	if err != nil || i < 1 || strconv.Itoa(i) != rest {
		return 0, false
	}
	return i, true
}

// SocketOf returns hostd's socket for port i: Socket, then Socket.1, ...
func SocketOf(socket string, i int) string {
	if i == 0 {
		return socket
	}
	return fmt.Sprintf("%s.%d", socket, i)
}

func (p Port) chardev(i int) string {
	if i == 0 {
		return "chr-" + p.ID
	}
	return fmt.Sprintf("chr-%s-%d", p.ID, i)
}

func (p Port) check() error {
	if p.ID == "" || strings.ContainsAny(p.ID, ", =") {
		return fmt.Errorf("port id %q: want a plain name", p.ID)
	}
	if !filepath.IsAbs(p.Socket) || strings.ContainsAny(p.Socket, ",") {
		return fmt.Errorf("port socket %q: want an absolute path without commas", p.Socket)
	}
	if p.Ports < 0 || p.Ports > 30 {
		return fmt.Errorf("ports %d: want 1 to 30 (a virtio-serial device has 31)", p.Ports)
	}
	return nil
}

// QEMUArgs returns the arguments for the ports: QEMU connects to hostd's
// sockets and reconnects every second while hostd is away.
func (p Port) QEMUArgs() ([]string, error) {
	if err := p.check(); err != nil {
		return nil, err
	}
	var args []string
	for i := range p.Count() {
		args = append(args, "-chardev", fmt.Sprintf("socket,id=%s,path=%s,reconnect=1", p.chardev(i), SocketOf(p.Socket, i)))
	}
	args = append(args, "-device", fmt.Sprintf("virtio-serial-pci,id=vser-%s", p.ID))
	for i := range p.Count() {
		args = append(args, "-device", fmt.Sprintf("virtserialport,bus=vser-%s.0,chardev=%s,name=%s", p.ID, p.chardev(i), PortName(i)))
	}
	return args, nil
}

// LibvirtXML returns the domain's <channel> elements. Each tells libvirt's
// DAC driver to leave the socket alone (relabel='no'): hostd creates it
// only once the domain runs, so with dynamic_ownership (libvirt's default)
// libvirt would fail to start the domain ("unable to stat"), and hostd
// gives the socket its owner and mode itself (root, 0600, or 0660 for the
// trust group's region_group).
func (p Port) LibvirtXML() (string, error) {
	if err := p.check(); err != nil {
		return "", err
	}
	var chans []string
	for i := range p.Count() {
		chans = append(chans, fmt.Sprintf("<channel type='unix'>\n  <source mode='connect' path='%s'>\n    <seclabel model='dac' relabel='no'/>\n    <reconnect enabled='yes' timeout='1'/>\n  </source>\n  <target type='virtio' name='%s'/>\n</channel>", SocketOf(p.Socket, i), PortName(i)))
	}
	return strings.Join(chans, "\n"), nil
}

// FindAll returns the character devices of all Shunt ports, port 0 first
// (each by its udev link if there is one).
func FindAll(sysfs, dev string) ([]string, error) {
	byIndex := map[int]string{}
	ports, _ := filepath.Glob(filepath.Join(sysfs, "class/virtio-ports/vport*"))
	for _, p := range ports {
		b, err := os.ReadFile(filepath.Join(p, "name"))
		if err != nil {
			continue
		}
		name := strings.TrimSpace(string(b))
		if i, ok := IndexOf(name); ok {
			byIndex[i] = filepath.Join(dev, filepath.Base(p))
			if _, err := os.Stat(filepath.Join(dev, "virtio-ports", name)); err == nil {
				byIndex[i] = filepath.Join(dev, "virtio-ports", name)
			}
		}
	}
	if len(byIndex) == 0 {
		if p, err := Find(sysfs, dev); err == nil {
			return []string{p}, nil
		}
		return nil, ErrNotFound
	}
	idx := make([]int, 0, len(byIndex))
	for i := range byIndex {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	out := make([]string, 0, len(idx))
	for _, i := range idx {
		out = append(out, byIndex[i])
	}
	return out, nil
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
