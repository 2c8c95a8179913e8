//go:build linux

package witness

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// Offsets in struct __sk_buff (include/uapi/linux/bpf.h).
const (
	skbIfindex = 40
	skbData    = 76
	skbDataEnd = 80
)

// Witness is the loaded program and its map. It is safe for concurrent use;
// Close detaches everything.
type Witness struct {
	m    *ebpf.Map
	prog *ebpf.Program

	mu    sync.Mutex
	links map[int]link.Link // by ifindex
}

// Load creates the map and the program (CAP_BPF and CAP_NET_ADMIN).
func Load() (*Witness, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Name: "shunt_syn", Type: ebpf.LRUHash, KeySize: 12, ValueSize: 4, MaxEntries: 1 << 16})
	if err != nil {
		return nil, fmt.Errorf("witness map: %w (needs CAP_BPF: run hostd as root)", err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "shunt_syn", Type: ebpf.SchedCLS, License: "Dual BSD/GPL", Instructions: program(m.FD())})
	if err != nil {
		m.Close()
		return nil, fmt.Errorf("witness program: %w", err)
	}
	return &Witness{m: m, prog: prog, links: map[int]link.Link{}}, nil
}

// program records ifindex by IPv4 tuple for TCP SYNs (SYN set, ACK clear)
// with a plain 20-byte IP header, and passes every packet on.
func program(mapFD int) asm.Instructions {
	const out = "out"
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, skbData, asm.Word),
		asm.LoadMem(asm.R3, asm.R6, skbDataEnd, asm.Word),
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14+20+20), // Ethernet + IPv4 + TCP
		asm.JGT.Reg(asm.R4, asm.R3, out),
		asm.LoadMem(asm.R5, asm.R2, 12, asm.Half), // EtherType, network order
		asm.JNE.Imm(asm.R5, 0x0008, out),          // 0x0800 as a little-endian load
		asm.LoadMem(asm.R5, asm.R2, 14, asm.Byte), // version, IHL
		asm.JNE.Imm(asm.R5, 0x45, out),
		asm.LoadMem(asm.R5, asm.R2, 14+9, asm.Byte), // protocol
		asm.JNE.Imm(asm.R5, 6, out),
		asm.LoadMem(asm.R5, asm.R2, 14+20+13, asm.Byte), // TCP flags
		asm.And.Imm(asm.R5, 0x12),
		asm.JNE.Imm(asm.R5, 0x02, out), // SYN without ACK
		// key at r10-16: saddr, daddr, sport, dport (wire order)
		asm.LoadMem(asm.R5, asm.R2, 14+12, asm.Word),
		asm.StoreMem(asm.RFP, -16, asm.R5, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, 14+16, asm.Word),
		asm.StoreMem(asm.RFP, -12, asm.R5, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, 14+20, asm.Half),
		asm.StoreMem(asm.RFP, -8, asm.R5, asm.Half),
		asm.LoadMem(asm.R5, asm.R2, 14+22, asm.Half),
		asm.StoreMem(asm.RFP, -6, asm.R5, asm.Half),
		// value at r10-4: the interface the SYN came in by
		asm.LoadMem(asm.R5, asm.R6, skbIfindex, asm.Word),
		asm.StoreMem(asm.RFP, -4, asm.R5, asm.Word),
		asm.LoadMapPtr(asm.R1, mapFD),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -16),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, -4),
		asm.Mov.Imm(asm.R4, 0), // BPF_ANY
		asm.FnMapUpdateElem.Call(),
		asm.Mov.Imm(asm.R0, 0).WithSymbol(out), // TCX_PASS
		asm.Return(),
	}
}

// Attach puts the program on the ingress of interface ifindex (in the
// calling thread's network namespace).
func (w *Witness) Attach(ifindex int) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.links[ifindex]; ok {
		return nil
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: w.prog, Attach: ebpf.AttachTCXIngress})
	if err != nil {
		return fmt.Errorf("attach witness to ifindex %d: %w (TCX needs Linux 6.6)", ifindex, err)
	}
	w.links[ifindex] = l
	return nil
}

// Detach takes the program off interface ifindex (a stopped VM's tap; the
// kernel already detached it if the tap is gone).
func (w *Witness) Detach(ifindex int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if l, ok := w.links[ifindex]; ok {
		l.Close()
		delete(w.links, ifindex)
	}
}

// ErrNoSYN means no SYN with that tuple was seen.
var ErrNoSYN = errors.New("witness: no SYN seen for this tuple")

// Origin returns the interface the SYN of src->dst came in by.
func (w *Witness) Origin(src, dst netip.AddrPort) (int, error) {
	if !src.Addr().Is4() || !dst.Addr().Is4() {
		return 0, fmt.Errorf("witness: IPv4 only: %w", ErrNoSYN)
	}
	var key [12]byte
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(key[0:], s[:])
	copy(key[4:], d[:])
	binary.BigEndian.PutUint16(key[8:], src.Port())
	binary.BigEndian.PutUint16(key[10:], dst.Port())
	var ifindex uint32
	if err := w.m.Lookup(key[:], &ifindex); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, ErrNoSYN
		}
		return 0, err
	}
	return int(ifindex), nil
}

// Close detaches the program everywhere and frees it.
func (w *Witness) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, l := range w.links {
		l.Close()
		delete(w.links, i)
	}
	w.prog.Close()
	return w.m.Close()
}
