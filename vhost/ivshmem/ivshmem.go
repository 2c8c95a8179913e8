// Package ivshmem attaches a Shunt region to a VM as an ivshmem-plain PCI
// device (QEMU docs/specs/ivshmem-spec: vendor 0x1af4, device 0x1110; BAR2
// is the shared memory) and finds that device again from inside the guest.
package ivshmem

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"strings"
)

// PCI ids of ivshmem (QEMU docs/specs/ivshmem-spec.rst).
const (
	Vendor   = 0x1af4
	DeviceID = 0x1110
)

// Device describes the region as a VM device.
type Device struct {
	ID   string // QEMU object/device id suffix, e.g. "shunt0"
	Path string // the region file; libvirt requires /dev/shm/NAME
	Size int64  // bytes; a power of two, at least 1 MiB (libvirt's minimum)
}

func (d Device) check() error {
	switch {
	case d.ID == "" || strings.ContainsAny(d.ID, ", ="):
		return fmt.Errorf("ivshmem id %q: want a plain name", d.ID)
	case d.Size < 1<<20 || bits.OnesCount64(uint64(d.Size)) != 1:
		return fmt.Errorf("ivshmem size %d: want a power of two of at least 1 MiB", d.Size)
	case !filepath.IsAbs(d.Path) || strings.ContainsAny(d.Path, ","):
		return fmt.Errorf("ivshmem path %q: want an absolute path without commas", d.Path)
	}
	return nil
}

// QEMUArgs returns the arguments that give a VM the region as BAR2 of an
// ivshmem-plain device, shared with every other mapping of the file.
func (d Device) QEMUArgs() ([]string, error) {
	if err := d.check(); err != nil {
		return nil, err
	}
	return []string{
		"-object", fmt.Sprintf("memory-backend-file,id=mem-%s,share=on,mem-path=%s,size=%d", d.ID, d.Path, d.Size),
		"-device", fmt.Sprintf("ivshmem-plain,id=%s,memdev=mem-%s", d.ID, d.ID),
	}, nil
}

// LibvirtXML returns the domain's <shmem> element. libvirt backs it with
// /dev/shm/NAME, so the region must live there.
func (d Device) LibvirtXML() (string, error) {
	if err := d.check(); err != nil {
		return "", err
	}
	dir, name := filepath.Split(d.Path)
	if filepath.Clean(dir) != "/dev/shm" {
		return "", fmt.Errorf("ivshmem path %s: libvirt needs the region in /dev/shm", d.Path)
	}
	return fmt.Sprintf("<shmem name='%s'>\n  <model type='ivshmem-plain'/>\n  <size unit='M'>%d</size>\n</shmem>", name, d.Size>>20), nil
}

// ErrNotFound means the guest has no ivshmem device.
var ErrNotFound = errors.New("no ivshmem device (PCI 1af4:1110) in this guest")

// Find looks for the ivshmem device under sysfs (normally "/sys"), enables
// it, and returns the path of its memory BAR, which guestlib maps as the
// region (docs/vm.md, "Discovery"; the C core's shunt_find_bar applies the
// same rules): the first device under bus/pci/devices with vendor 0x1af4
// and device 0x1110 (by ids, not by address), enabled unless its enable
// file says "1" already (writing "1" needs root, and counts one more
// enable each time), and its resource2.
func Find(sysfs string) (string, error) {
	devs, err := List(sysfs)
	if err != nil {
		return "", err
	}
	if len(devs) == 0 {
		return "", ErrNotFound
	}
	return BAR(devs[0])
}

// List returns the sysfs directories of every ivshmem device under sysfs
// (bus/pci/devices, by ids), in address order. A VM of a trust group with
// pair regions has one per peer VM it has flows with, each found by the
// region header it shows (docs/vm.md, "Pair regions").
func List(sysfs string) ([]string, error) {
	devs, err := filepath.Glob(filepath.Join(sysfs, "bus/pci/devices/*"))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, dev := range devs {
		if hasID(dev, "vendor", Vendor) && hasID(dev, "device", DeviceID) {
			out = append(out, dev)
		}
	}
	return out, nil
}

// BAR enables the ivshmem device at dev (a sysfs directory from List)
// unless it is enabled already, and returns the path of its memory BAR,
// resource2.
func BAR(dev string) (string, error) {
	if !enabled(dev) {
		if err := os.WriteFile(filepath.Join(dev, "enable"), []byte("1"), 0); err != nil {
			return "", fmt.Errorf("enable ivshmem %s (needs root): %w", filepath.Base(dev), err)
		}
	}
	bar := filepath.Join(dev, "resource2")
	if _, err := os.Stat(bar); err != nil {
		return "", fmt.Errorf("ivshmem %s has no BAR2: %w", filepath.Base(dev), err)
	}
	return bar, nil
}

// Rescan asks the guest kernel to rescan the PCI buses (writes "1" to
// bus/pci/rescan; needs root): for a hot-plugged device whose hotplug
// event the kernel did not act on (no hotplug driver for its slot).
func Rescan(sysfs string) error {
	if err := os.WriteFile(filepath.Join(sysfs, "bus/pci/rescan"), []byte("1"), 0); err != nil {
		return fmt.Errorf("rescan PCI (needs root): %w", err)
	}
	return nil
}

func hasID(dev, file string, want int) bool {
	b, err := os.ReadFile(filepath.Join(dev, file))
	if err != nil {
		return false
	}
	var got int
	_, err = fmt.Sscanf(strings.TrimSpace(string(b)), "0x%x", &got)
	return err == nil && got == want
}

// enabled reports whether the device's enable file says it is enabled.
func enabled(dev string) bool {
	b, err := os.ReadFile(filepath.Join(dev, "enable"))
	return err == nil && strings.TrimSpace(string(b)) == "1"
}
