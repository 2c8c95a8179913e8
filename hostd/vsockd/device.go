package vsockd

import (
	"fmt"

	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// device makes dev, or keeps the device it has with dev's socket and
// CID, taking dev's name and id in place: renaming a guest in hostd.hcl
// or giving it another id must not cost its running VM the vsock (QEMU
// 7.2 does not reconnect). A device whose socket or CID changed is
// closed and made afresh, but not while its QEMU is connected: that VM
// would lose its vsock until it restarts, so the change is refused (the
// error is hostd's to log) and the device goes on as it was.
func (d *Daemon) device(ctl *controller, dev Device) {
	d.reserve(ctl)
	d.mu.Lock()
	refuse := func(format string, args ...any) {
		d.answerLocked(ctl, Msg{Op: OpError, Error: fmt.Sprintf("guest %s: ", dev.Guest) + fmt.Sprintf(format, args...)})
		d.mu.Unlock()
	}
	var bySocket *served
	for _, s := range d.devs {
		if s.dev.Socket == dev.Socket {
			bySocket = s
		}
	}
	byID := d.devs[dev.ID]
	if bySocket != nil && bySocket.dev.CID == dev.CID {
		if bySocket != byID && byID != nil {
			refuse("its socket is guest %s's device's (id %d) and its id guest %s's (socket %s): give each guest one id and one socket (stop the VMs to swap them)",
				bySocket.dev.Guest, bySocket.dev.ID, byID.dev.Guest, byID.dev.Socket)
			return
		}
		if bySocket.dev != dev {
			d.log.Info("device renamed: kept with its QEMU", "old", fmt.Sprintf("%+v", bySocket.dev), "new", fmt.Sprintf("%+v", dev))
			delete(d.devs, bySocket.dev.ID)
			bySocket.dev = dev
			d.devs[dev.ID] = bySocket
		}
		d.answerLocked(ctl, Msg{Op: OpDevice, ID: dev.ID, Kept: true, Connected: bySocket.connected})
		d.mu.Unlock()
		return
	}
	// old is the device dev replaces: its socket's, or else its id's.
	old := bySocket
	if old == nil {
		old = byID
	} else if byID != nil && byID != old {
		refuse("its socket is guest %s's device's and its id guest %s's", old.dev.Guest, byID.dev.Guest)
		return
	}
	if old != nil && old.connected {
		refuse("its QEMU is connected to the device with socket %s and cid %d: a new socket or cid (%s, %d) would leave the VM without vsock until it restarts, so the device goes on as it was; stop the VM, then restart hostd to make the new one",
			old.dev.Socket, old.dev.CID, dev.Socket, dev.CID)
		return
	}
	for _, s := range d.devs {
		if s != old && s.dev.CID == dev.CID {
			refuse("its cid %d is guest %s's", dev.CID, s.dev.Guest)
			return
		}
	}
	if old == nil && len(d.devs) >= maxDevices {
		refuse("%d devices already", maxDevices)
		return
	}
	if old != nil {
		delete(d.devs, old.dev.ID)
	}
	d.mu.Unlock()
	if old != nil {
		d.log.Warn("device changed while no QEMU was connected: the old one closed", "old", fmt.Sprintf("%+v", old.dev), "new", fmt.Sprintf("%+v", dev))
		old.close()
	}
	s, err := d.start(dev)
	d.mu.Lock()
	if err != nil {
		d.answerLocked(ctl, Msg{Op: OpError, Error: err.Error()})
		d.mu.Unlock()
		return
	}
	if d.closed {
		d.answerLocked(ctl, Msg{Op: OpError, Error: "shutting down"})
		d.mu.Unlock()
		s.close() // here, by its owner: Close waits for this goroutine
		return
	}
	d.devs[dev.ID] = s
	d.answerLocked(ctl, Msg{Op: OpDevice, ID: dev.ID, Connected: s.connected})
	d.mu.Unlock()
}

// start makes a device, its socket and its forwarder.
func (d *Daemon) start(dev Device) (*served, error) {
	s := &served{dev: dev}
	spec := vsockhost.Spec{Guest: dev.Guest, ID: dev.ID, Socket: dev.Socket, CID: dev.CID,
		Restart: "shunt-vsockd restarts (hostd's restart does not remake a device the daemon has)",
		Frontend: func(connected bool) {
			d.mu.Lock()
			defer d.mu.Unlock()
			s.connected = connected
			// s.dev.ID, not dev.ID: the device may have been given
			// another id since.
			d.eventLocked(d.ctl, Msg{Op: OpFrontend, ID: s.dev.ID, Connected: connected})
		}}
	room, err := vsockhost.Start(d.log.Named("vsock"), []vsockhost.Spec{spec})
	if err != nil {
		return nil, err
	}
	s.room = room
	if s.fwd, err = vsock.ServeHybridGuest(room.Device(dev.ID), dev.Socket, Ports...); err != nil {
		room.Close()
		return nil, fmt.Errorf("guest %s: forward to hostd: %w", dev.Guest, err)
	}
	d.log.Info("device made", "guest", dev.Guest, "cid", dev.CID, "socket", dev.Socket)
	return s, nil
}
