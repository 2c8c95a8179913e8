package vhost

import (
	"fmt"
	"strings"

	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// Attachment is everything a VM needs for Shunt: its trust group's region
// and its control channel. A plain value.
type Attachment struct {
	Region  ivshmem.Device
	Control vserial.Port
}

// QEMUArgs returns the QEMU command-line arguments for both devices.
func (a Attachment) QEMUArgs() ([]string, error) {
	r, err := a.Region.QEMUArgs()
	if err != nil {
		return nil, err
	}
	c, err := a.Control.QEMUArgs()
	if err != nil {
		return nil, err
	}
	return append(r, c...), nil
}

// LibvirtXML returns the <devices> children for a libvirt domain.
func (a Attachment) LibvirtXML() (string, error) {
	r, err := a.Region.LibvirtXML()
	if err != nil {
		return "", err
	}
	c, err := a.Control.LibvirtXML()
	if err != nil {
		return "", err
	}
	return strings.Join([]string{r, c}, "\n"), nil
}

// String describes the attachment for logs.
func (a Attachment) String() string {
	return fmt.Sprintf("region %s (%d bytes), control %s", a.Region.Path, a.Region.Size, a.Control.Socket)
}
