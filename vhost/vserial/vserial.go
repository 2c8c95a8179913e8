// Package vserial gives a VM its control channel to hostd as a
// virtio-serial port named org.shunt.ctl, bound to a Unix socket that hostd
// listens on (one per VM: the channel is the guest's identity), and finds
// and opens a port from inside the guest (FindAll, Open: the rules of
// docs/vm.md, "Discovery", which guestlib uses and the C core repeats).
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
	"syscall"
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

// FindAll returns the character devices of this guest's Shunt ports in
// the order a process tries them, port 0 first (docs/vm.md, "Discovery";
// the C core's shunt_find_ports applies the same rules):
//
//   - every entry of sysfs/class/virtio-ports whose name file holds
//     PortName(i) is port i, at dev/<entry> (/dev/vport1p2: guests without
//     udev);
//   - every udev link dev/virtio-ports/PortName(i) that exists is port i
//     too, and wins over the sysfs entry (and is enough without sysfs).
//
// It returns ErrNotFound if there is none. sysfs and dev are normally
// "/sys" and "/dev".
func FindAll(sysfs, dev string) ([]string, error) {
	byIndex := map[int]string{}
	classDir := filepath.Join(sysfs, "class/virtio-ports")
	entries, _ := os.ReadDir(classDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(classDir, e.Name(), "name"))
		if err != nil {
			continue
		}
		if i, ok := IndexOf(strings.TrimSpace(string(b))); ok {
			byIndex[i] = filepath.Join(dev, e.Name())
		}
	}
	udevDir := filepath.Join(dev, "virtio-ports")
	links, _ := os.ReadDir(udevDir)
	for _, e := range links {
		i, ok := IndexOf(e.Name())
		if !ok {
			continue
		}
		if _, err := os.Stat(filepath.Join(udevDir, e.Name())); err == nil {
			byIndex[i] = filepath.Join(udevDir, e.Name())
		}
	}
	if len(byIndex) == 0 {
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
var ErrNotFound = errors.New("no virtio-serial port named " + Name + "[.N] in this guest")

// ErrAllBusy means every Shunt port of the guest is held by another
// process: a port has one user at a time, so the VM needs more ports
// (control_ports in hostd.hcl) or fewer processes using Shunt at once.
var ErrAllBusy = errors.New("every " + Name + " port is in use by another process")

// Open opens the first of ports (FindAll's order) that no other process
// holds: the guest kernel lets a port be open once at a time and answers
// any other open EBUSY, so a busy port is skipped and the next one tried.
// Any other failure ends the search with its error, as does ErrAllBusy
// when every port is busy. The caller owns the returned file (read-write,
// close-on-exec, non-blocking under Go's poller so that deadlines work;
// its Name is the port's path); closing it frees the port.
func Open(ports []string) (*os.File, error) {
	for _, p := range ports {
		f, err := openPort(p)
		if errors.Is(err, syscall.EBUSY) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open control port: %w", err)
		}
		return f, nil
	}
	if len(ports) == 0 {
		return nil, ErrNotFound
	}
	return nil, fmt.Errorf("%w: %d ports (a VM needs one per process using Shunt at once: control_ports in hostd.hcl)", ErrAllBusy, len(ports))
}

// openPort opens one port; a variable for tests, where nothing answers
// EBUSY. O_NOCTTY: a port is no terminal, but a test's stand-in may be.
var openPort = func(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDWR|syscall.O_NOCTTY, 0)
}
