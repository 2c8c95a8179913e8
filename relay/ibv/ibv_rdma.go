//go:build rdma && cgo && linux

package ibv

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include <infiniband/verbs.h>
#include "shim.h"
*/
import "C"

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"
	"unsafe"

	"github.com/shuntnet/shunt/relay"
)

// qp is one RC queue pair of the shim, as a relay.Verbs. Its calls follow
// the link's use: Write from the link's writer; Poll, Sleep, PostRecv and
// WriteCredit from its poller.
type qp struct {
	s          *C.struct_shim
	me         relay.Endpoint
	send, recv []byte
	credit     *[2]uint64
	wcs        []C.struct_shim_wc
	// dev is the device's name, node its uverbs node in sysfs, which
	// the kernel deletes first when the device's removal begins (Gone).
	dev, node string
}

var _ relay.DeviceWatch = (*qp)(nil)

// Open makes a queue pair on a device, in state INIT, with its buffers
// registered.
func Open(c Config) (relay.Verbs, error) {
	if c.Port == 0 {
		c.Port = 1
	}
	if c.Size < relay.MinRing || c.Size > relay.MaxRing || c.Size%4096 != 0 || c.Depth < relay.MinDepth || c.Depth > relay.MaxDepth {
		return nil, fmt.Errorf("ibv: ring of %d bytes, depth %d: out of bounds", c.Size, c.Depth)
	}
	if c.Device == "" || c.GIDIndex < 0 {
		devs, err := relay.RDMADevices("")
		if err != nil {
			return nil, err
		}
		d, p, g, ok := relay.PickRDMA(devs, c.Device)
		if !ok {
			return nil, errors.New("ibv: no active RDMA port with an address")
		}
		if c.Device == "" {
			c.Device, c.Port = d, p
		}
		if c.GIDIndex < 0 {
			c.GIDIndex = g
		}
	}
	var psnb [4]byte
	rand.Read(psnb[:])
	dev := C.CString(c.Device)
	defer C.free(unsafe.Pointer(dev))
	var errb [256]C.char
	var info C.struct_shim_info
	q := &qp{}
	if rc := C.shim_open(dev, C.int(c.Port), C.int(c.GIDIndex), C.uint32_t(c.Size), C.int(c.Depth),
		C.uint32_t(binary.LittleEndian.Uint32(psnb[:])), &q.s, &info, &errb[0], C.int(len(errb))); rc != 0 {
		return nil, fmt.Errorf("ibv: %s", C.GoString(&errb[0]))
	}
	q.me = relay.Endpoint{QPN: uint32(info.qpn), PSN: uint32(info.psn), LID: uint16(info.lid), MTU: uint8(info.mtu),
		Ring: uint64(info.ring), RKey: uint32(info.rkey), Size: uint32(c.Size), Depth: uint32(c.Depth)}
	for i := range q.me.GID {
		q.me.GID[i] = byte(info.gid[i])
	}
	sb, rb := C.shim_send_buf(q.s), C.shim_recv_buf(q.s)
	q.send = unsafe.Slice((*byte)(sb), c.Size)
	q.recv = unsafe.Slice((*byte)(rb), c.Size)
	q.credit = (*[2]uint64)(unsafe.Add(rb, c.Size))
	q.wcs = make([]C.struct_shim_wc, 64)
	q.dev, q.node = C.GoString(C.shim_dev_name(q.s)), C.GoString(C.shim_dev_path(q.s))
	return q, nil
}

func (q *qp) Local() relay.Endpoint { return q.me }
func (q *qp) Send() []byte          { return q.send }
func (q *qp) Recv() []byte          { return q.recv }
func (q *qp) Credit() *[2]uint64    { return q.credit }

func (q *qp) Connect(p relay.Endpoint) error {
	info := C.struct_shim_info{qpn: C.uint32_t(p.QPN), psn: C.uint32_t(p.PSN), lid: C.uint16_t(p.LID), mtu: C.uint8_t(p.MTU),
		ring: C.uint64_t(p.Ring), rkey: C.uint32_t(p.RKey)}
	for i, b := range p.GID {
		info.gid[i] = C.uint8_t(b)
	}
	var errb [256]C.char
	if C.shim_connect(q.s, &info, &errb[0], C.int(len(errb))) != 0 {
		return fmt.Errorf("ibv: %s", C.GoString(&errb[0]))
	}
	return nil
}

func errno(rc C.int) error {
	if rc == 0 {
		return nil
	}
	return syscall.Errno(-rc)
}

func (q *qp) Write(off, n int) error { return errno(C.shim_write(q.s, C.uint32_t(off), C.uint32_t(n))) }

func (q *qp) WriteCredit(bytes, batches uint64) error {
	return errno(C.shim_write_credit(q.s, C.uint64_t(bytes), C.uint64_t(batches)))
}

func (q *qp) PostRecv(k int) error { return errno(C.shim_post_recv(q.s, C.int(k))) }

func (q *qp) Poll(cs []relay.Completion) (int, error) {
	n := min(len(cs), len(q.wcs))
	got := C.shim_poll(q.s, &q.wcs[0], C.int(n))
	if got < 0 {
		return 0, errno(got)
	}
	for i := range int(got) {
		w := q.wcs[i]
		c := relay.Completion{Op: relay.Op(w.op), Imm: uint32(w.imm), Status: int(w.status)}
		switch {
		case c.Status == -1:
			c.Detail = "an incoming operation other than RDMA WRITE WITH IMMEDIATE"
		case c.Status != 0:
			c.Detail = C.GoString(C.ibv_wc_status_str(uint32(w.status)))
		}
		cs[i] = c
	}
	return int(got), nil
}

// Gone says whether the device's removal has begun: its uverbs node in
// sysfs is gone (the kernel deletes it before it waits for the processes
// that hold the device). A relay.DeviceWatch.
func (q *qp) Gone() error {
	if q.node == "" {
		return nil
	}
	if _, err := os.Stat(q.node); errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("device %s removed (%s is gone)", q.dev, q.node)
	}
	return nil
}

func (q *qp) Sleep(d time.Duration) error {
	return errno(C.shim_sleep(q.s, C.int(d/time.Millisecond)))
}

// Break moves the queue pair to the error state: a fault injected by
// tests (shunt-rdma stream -fault), as a NIC or fabric error would.
func (q *qp) Break() error { return errno(C.shim_break(q.s)) }

func (q *qp) Close() error {
	C.shim_close(q.s)
	q.s = nil
	return nil
}
