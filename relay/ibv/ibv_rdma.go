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
	"sync"
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

	// Guest memory registered for local reads (relay.Gather): Register
	// and Deregister come from the relay's goroutines, WriteSG from the
	// link's writer.
	maxSGE  int
	sendKey C.uint32_t
	sges    []C.struct_shim_sge // the writer's
	regMu   sync.Mutex
	regs    map[uint32]mreg
	nextKey uint32
}

// mreg is one registration: where it lies, for the bounds check of each
// scatter entry.
type mreg struct {
	mr   unsafe.Pointer
	base uintptr
	len  uint64
	lkey C.uint32_t
}

var (
	_ relay.DeviceWatch = (*qp)(nil)
	_ relay.Gather      = (*qp)(nil)
)

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
	q.maxSGE, q.sendKey = int(C.shim_max_sge(q.s)), C.shim_send_lkey(q.s)
	q.sges, q.regs = make([]C.struct_shim_sge, max(q.maxSGE, 1)), map[uint32]mreg{}
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

func (q *qp) MaxSGE() int { return q.maxSGE }

// Register registers mem (the relay's mapping of a guest region) for
// this NIC to read: no remote access, the pages pinned until Deregister.
func (q *qp) Register(mem []byte) (uint32, error) {
	if len(mem) == 0 {
		return 0, errors.New("ibv: register an empty region")
	}
	var errb [256]C.char
	var lkey C.uint32_t
	base := unsafe.Pointer(unsafe.SliceData(mem))
	mr := C.shim_reg(q.s, base, C.size_t(len(mem)), &lkey, &errb[0], C.int(len(errb)))
	if mr == nil {
		return 0, fmt.Errorf("ibv: %s", C.GoString(&errb[0]))
	}
	q.regMu.Lock()
	defer q.regMu.Unlock()
	q.nextKey++
	for q.nextKey == 0 || q.regs[q.nextKey].mr != nil {
		q.nextKey++
	}
	q.regs[q.nextKey] = mreg{mr: mr, base: uintptr(base), len: uint64(len(mem)), lkey: lkey}
	return q.nextKey, nil
}

func (q *qp) Deregister(key uint32) error {
	q.regMu.Lock()
	r, ok := q.regs[key]
	delete(q.regs, key)
	q.regMu.Unlock()
	if !ok {
		return fmt.Errorf("ibv: key %d is not registered", key)
	}
	return errno(C.shim_dereg(r.mr))
}

// WriteSG checks each entry against its registration's bounds and posts
// one write gathering them.
func (q *qp) WriteSG(off, n int, sg []relay.SGE) error {
	if len(sg) == 0 || len(sg) > q.maxSGE {
		return fmt.Errorf("ibv: a write of %d scatter entries (at most %d)", len(sg), q.maxSGE)
	}
	q.regMu.Lock()
	for i, e := range sg {
		var r mreg
		if e.Key == 0 {
			r = mreg{base: uintptr(unsafe.Pointer(unsafe.SliceData(q.send))), len: uint64(len(q.send)), lkey: q.sendKey}
		} else if r = q.regs[e.Key]; r.mr == nil {
			q.regMu.Unlock()
			return fmt.Errorf("ibv: scatter entry of key %d: not registered", e.Key)
		}
		if e.Off > r.len || uint64(e.Len) > r.len-e.Off {
			q.regMu.Unlock()
			return fmt.Errorf("ibv: scatter entry %d+%d outside its registration of %d bytes", e.Off, e.Len, r.len)
		}
		q.sges[i] = C.struct_shim_sge{addr: C.uint64_t(uint64(r.base) + e.Off), len: C.uint32_t(e.Len), lkey: r.lkey}
	}
	q.regMu.Unlock()
	return errno(C.shim_write_sg(q.s, C.uint32_t(off), C.uint32_t(n), &q.sges[0], C.int(len(sg))))
}

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
