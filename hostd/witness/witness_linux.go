//go:build linux

package witness

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Offsets in struct __sk_buff (include/uapi/linux/bpf.h).
const (
	skbIfindex = 40
	skbData    = 76
	skbDataEnd = 80
)

// bpfNoExist is BPF_NOEXIST: create a map element only if it is new.
const bpfNoExist = 1

// Witness is the loaded program and its maps. It is safe for concurrent
// use; Close detaches everything and stops the sweeper.
type Witness struct {
	syn   *ebpf.Map // tuple -> record
	perIf *ebpf.Map // ifindex -> records it holds, for the quota
	stats *ebpf.Map // counters, by Stat index
	prog  *ebpf.Program
	opts  Options

	stop chan struct{}
	done chan struct{}

	mu    sync.Mutex
	links map[int]link.Link // by ifindex
}

// Load creates the maps and the program with the default Options and
// starts the sweeper (CAP_BPF and CAP_NET_ADMIN).
func Load() (*Witness, error) { return LoadWith(Options{}) }

// LoadWith is Load with options.
func LoadWith(o Options) (_ *Witness, err error) {
	o = o.withDefaults()
	w := &Witness{opts: o, links: map[int]link.Link{}, stop: make(chan struct{}), done: make(chan struct{})}
	defer func() {
		if err != nil {
			w.closeObjects()
		}
	}()
	// A plain hash, not an LRU: a burst of SYNs cannot evict a live record;
	// when the map is full, new records are refused and counted.
	if w.syn, err = ebpf.NewMap(&ebpf.MapSpec{Name: "shunt_syn", Type: ebpf.Hash, KeySize: keySize, ValueSize: 16, MaxEntries: uint32(o.MaxRecords)}); err != nil {
		return nil, fmt.Errorf("witness map: %w (needs CAP_BPF: run hostd as root)", err)
	}
	if w.perIf, err = ebpf.NewMap(&ebpf.MapSpec{Name: "shunt_syn_if", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 4096}); err != nil {
		return nil, fmt.Errorf("witness map: %w", err)
	}
	if w.stats, err = ebpf.NewMap(&ebpf.MapSpec{Name: "shunt_syn_stat", Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: uint32(numStats)}); err != nil {
		return nil, fmt.Errorf("witness map: %w", err)
	}
	ins := program(w.syn.FD(), w.perIf.FD(), w.stats.FD(), o.PerInterface)
	if w.prog, err = ebpf.NewProgram(&ebpf.ProgramSpec{Name: "shunt_syn", Type: ebpf.SchedCLS, License: "Dual BSD/GPL", Instructions: ins}); err != nil {
		return nil, fmt.Errorf("witness program: %w", err)
	}
	go w.sweeper()
	return w, nil
}

// keySize is a record's key: source and destination address (16 bytes
// each, an IPv4 one as IPv4-mapped IPv6, ::ffff:a.b.c.d), source and
// destination port, all in network order as on the wire.
const keySize = 36

// program records, for each TCP SYN without ACK that has a plain 20-byte
// IPv4 header or an IPv6 header whose next header is TCP (no extension
// headers), the interface it came in by, keyed by its tuple, and passes
// every packet on:
//
//   - a new tuple is recorded (BPF_NOEXIST), unless its interface already
//     holds perIf records (quota) or the map is full: counted, refused;
//   - a SYN for a recorded tuple from the same interface refreshes the
//     record's time (a retransmitted SYN);
//   - a SYN for a recorded tuple from another interface changes nothing:
//     the first SYN wins, and the conflict is counted.
//
// Record: ifindex (u32), pad (u32), time (u64, bpf_ktime_get_ns).
// Stack: key fp-40..-5 (saddr fp-40, daddr fp-24, sport fp-8, dport
// fp-6), quota key fp-44, count fp-48, record fp-64..-49, stat index
// fp-68.
func program(synFD, perIfFD, statsFD int, perIf int) asm.Instructions {
	const (
		out   = "out"
		key   = -40 // the tuple key on the stack
		quota = -44
		count = -48
		rec   = -64
		stat  = -68
		v4    = 14      // IPv4 header, after Ethernet
		v4TCP = v4 + 20 // its TCP header
		v6    = 14      // IPv6 header
		v6TCP = v6 + 40
	)
	ins := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, skbData, asm.Word),
		asm.LoadMem(asm.R3, asm.R6, skbDataEnd, asm.Word),
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14),
		asm.JGT.Reg(asm.R4, asm.R3, out),
		asm.LoadMem(asm.R5, asm.R2, 12, asm.Half), // EtherType, network order
		asm.JEq.Imm(asm.R5, 0xdd86, "ipv6"),       // 0x86dd as a little-endian load
		asm.JNE.Imm(asm.R5, 0x0008, out),          // 0x0800
		// IPv4
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, v4TCP+20),
		asm.JGT.Reg(asm.R4, asm.R3, out),
		asm.LoadMem(asm.R5, asm.R2, v4, asm.Byte), // version, IHL
		asm.JNE.Imm(asm.R5, 0x45, out),
		asm.LoadMem(asm.R5, asm.R2, v4+9, asm.Byte), // protocol
		asm.JNE.Imm(asm.R5, 6, out),
		asm.LoadMem(asm.R5, asm.R2, v4TCP+13, asm.Byte), // TCP flags
		asm.And.Imm(asm.R5, 0x12),
		asm.JNE.Imm(asm.R5, 0x02, out), // SYN without ACK
		// key: ::ffff:saddr, ::ffff:daddr, sport, dport (wire order)
		asm.Mov.Imm(asm.R5, 0), // (no 64-bit store of an immediate)
		asm.StoreMem(asm.RFP, key, asm.R5, asm.DWord),
		asm.StoreImm(asm.RFP, key+8, 0, asm.Half),
		asm.StoreImm(asm.RFP, key+10, 0xffff, asm.Half),
		asm.StoreMem(asm.RFP, key+16, asm.R5, asm.DWord),
		asm.LoadMem(asm.R5, asm.R2, v4+12, asm.Word),
		asm.StoreMem(asm.RFP, key+12, asm.R5, asm.Word),
		asm.StoreImm(asm.RFP, key+24, 0, asm.Half),
		asm.StoreImm(asm.RFP, key+26, 0xffff, asm.Half),
		asm.LoadMem(asm.R5, asm.R2, v4+16, asm.Word),
		asm.StoreMem(asm.RFP, key+28, asm.R5, asm.Word),
		asm.LoadMem(asm.R5, asm.R2, v4TCP, asm.Half),
		asm.StoreMem(asm.RFP, key+32, asm.R5, asm.Half),
		asm.LoadMem(asm.R5, asm.R2, v4TCP+2, asm.Half),
		asm.StoreMem(asm.RFP, key+34, asm.R5, asm.Half),
		asm.Ja.Label("keyed"),
		// IPv6, TCP right after the fixed header
		asm.Mov.Reg(asm.R4, asm.R2).WithSymbol("ipv6"),
		asm.Add.Imm(asm.R4, v6TCP+20),
		asm.JGT.Reg(asm.R4, asm.R3, out),
		asm.LoadMem(asm.R5, asm.R2, v6, asm.Byte), // version, traffic class
		asm.And.Imm(asm.R5, 0xf0),
		asm.JNE.Imm(asm.R5, 0x60, out),
		asm.LoadMem(asm.R5, asm.R2, v6+6, asm.Byte), // next header
		asm.JNE.Imm(asm.R5, 6, out),
		asm.LoadMem(asm.R5, asm.R2, v6TCP+13, asm.Byte), // TCP flags
		asm.And.Imm(asm.R5, 0x12),
		asm.JNE.Imm(asm.R5, 0x02, out), // SYN without ACK
	}
	// An IPv4-mapped address in an IPv6 header names no real connection
	// (no stack answers such a SYN) and would take an IPv4 tuple's key:
	// not recorded.
	for _, a := range []int16{v6 + 8, v6 + 24} {
		next := fmt.Sprintf("unmapped%d", a)
		ins = append(ins,
			asm.LoadMem(asm.R5, asm.R2, a, asm.Word),
			asm.JNE.Imm(asm.R5, 0, next),
			asm.LoadMem(asm.R5, asm.R2, a+4, asm.Word),
			asm.JNE.Imm(asm.R5, 0, next),
			asm.LoadMem(asm.R5, asm.R2, a+8, asm.Word),
			asm.JEq.Imm32(asm.R5, -0x10000, out), // 00 00 ff ff as a little-endian load
			asm.Mov.Imm(asm.R5, 0).WithSymbol(next),
		)
	}
	// key: saddr, daddr (v6+8, v6+24: 32 bytes), sport, dport
	for off := int16(0); off < 32; off += 4 {
		ins = append(ins,
			asm.LoadMem(asm.R5, asm.R2, v6+8+off, asm.Word),
			asm.StoreMem(asm.RFP, key+off, asm.R5, asm.Word))
	}
	ins = append(ins,
		asm.LoadMem(asm.R5, asm.R2, v6TCP, asm.Half),
		asm.StoreMem(asm.RFP, key+32, asm.R5, asm.Half),
		asm.LoadMem(asm.R5, asm.R2, v6TCP+2, asm.Half),
		asm.StoreMem(asm.RFP, key+34, asm.R5, asm.Half),
		asm.LoadMem(asm.R7, asm.R6, skbIfindex, asm.Word).WithSymbol("keyed"), // r7: the interface
		asm.FnKtimeGetNs.Call(),
		asm.Mov.Reg(asm.R8, asm.R0), // r8: now
		// A record for this tuple?
		asm.LoadMapPtr(asm.R1, synFD),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, key),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "new"),
		asm.LoadMem(asm.R1, asm.R0, 0, asm.Word),
		asm.JNE.Reg(asm.R1, asm.R7, "conflict"),
		asm.StoreMem(asm.R0, 8, asm.R8, asm.DWord), // same interface: refresh
		asm.Ja.Label(out),
		// A new tuple: within its interface's quota?
		asm.StoreMem(asm.RFP, quota, asm.R7, asm.Word).WithSymbol("new"),
		asm.LoadMapPtr(asm.R1, perIfFD),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, quota),
		asm.FnMapLookupElem.Call(),
		asm.Mov.Reg(asm.R9, asm.R0), // r9: its count, or NULL
		asm.JEq.Imm(asm.R9, 0, "insert"),
		asm.LoadMem(asm.R1, asm.R9, 0, asm.Word),
		asm.JGE.Imm(asm.R1, int32(perIf), "quota"),
		asm.StoreMem(asm.RFP, rec, asm.R7, asm.Word).WithSymbol("insert"),
		asm.StoreImm(asm.RFP, rec+4, 0, asm.Word),
		asm.StoreMem(asm.RFP, rec+8, asm.R8, asm.DWord),
		asm.LoadMapPtr(asm.R1, synFD),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, key),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, rec),
		asm.Mov.Imm(asm.R4, bpfNoExist),
		asm.FnMapUpdateElem.Call(),
		asm.JNE.Imm(asm.R0, 0, "full"),
		asm.JEq.Imm(asm.R9, 0, "first"),
		asm.Mov.Imm(asm.R1, 1),
		asm.AddAtomic.Mem(asm.R9, asm.R1, asm.Word, 0),
		asm.Ja.Label("recorded"),
		asm.StoreImm(asm.RFP, count, 1, asm.Word).WithSymbol("first"),
		asm.LoadMapPtr(asm.R1, perIfFD),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, quota),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, count),
		asm.Mov.Imm(asm.R4, bpfNoExist),
		asm.FnMapUpdateElem.Call(),
	)
	for _, s := range []struct {
		label string
		stat  Stat
	}{{"recorded", StatRecorded}, {"conflict", StatConflicts}, {"full", StatFull}, {"quota", StatOverQuota}} {
		ins = append(ins,
			asm.StoreImm(asm.RFP, stat, int64(s.stat), asm.Word).WithSymbol(s.label),
			asm.LoadMapPtr(asm.R1, statsFD),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, stat),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, out),
			asm.Mov.Imm(asm.R1, 1),
			asm.AddAtomic.Mem(asm.R0, asm.R1, asm.DWord, 0),
			asm.Ja.Label(out),
		)
	}
	return append(ins,
		asm.Mov.Imm(asm.R0, 0).WithSymbol(out), // TCX_PASS
		asm.Return(),
	)
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

// key is the program's key of the tuple src->dst (IPv4 as IPv4-mapped
// IPv6, whichever form the caller gives).
func key(src, dst netip.AddrPort) [keySize]byte {
	var k [keySize]byte
	s, d := src.Addr().As16(), dst.Addr().As16()
	copy(k[0:], s[:])
	copy(k[16:], d[:])
	binary.BigEndian.PutUint16(k[32:], src.Port())
	binary.BigEndian.PutUint16(k[34:], dst.Port())
	return k
}

// Origin returns the interface the first SYN of src->dst came in by.
func (w *Witness) Origin(src, dst netip.AddrPort) (int, error) {
	src, dst = unmap(src), unmap(dst)
	if src.Addr().Is4() != dst.Addr().Is4() || src.Addr().Zone() != "" || dst.Addr().Zone() != "" {
		return 0, ErrNoSYN // no packet has one IPv4 and one IPv6 address
	}
	k := key(src, dst)
	var rec [16]byte
	if err := w.syn.Lookup(k[:], &rec); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, ErrNoSYN
		}
		return 0, err
	}
	return int(binary.NativeEndian.Uint32(rec[0:])), nil
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }

// Stats reads the program's counters.
func (w *Witness) Stats() Stats {
	var out Stats
	for i, p := range []*uint64{&out.Recorded, &out.Conflicts, &out.Full, &out.OverQuota} {
		_ = w.stats.Lookup(uint32(i), p)
	}
	return out
}

// Sweep deletes the records older than TTL and recounts what each
// interface holds; it returns how many records it deleted. The sweeper
// calls it every SweepEvery; tests may call it directly.
func (w *Witness) Sweep() int {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	oldest := uint64(ts.Nano()) - uint64(w.opts.TTL.Nanoseconds())
	var (
		stale  [][keySize]byte
		kk     [keySize]byte
		rec    [16]byte
		counts = map[uint32]uint32{}
	)
	it := w.syn.Iterate()
	for it.Next(&kk, &rec) {
		if binary.NativeEndian.Uint64(rec[8:]) < oldest {
			stale = append(stale, kk)
			continue
		}
		counts[binary.NativeEndian.Uint32(rec[0:])]++
	}
	for _, s := range stale {
		_ = w.syn.Delete(s[:])
	}
	// The counts race with the program's increments between the walk and
	// these writes: off by the SYNs of those microseconds, and put right
	// at the next sweep.
	var ifk, n uint32
	var seen []uint32
	ifit := w.perIf.Iterate()
	for ifit.Next(&ifk, &n) {
		seen = append(seen, ifk)
	}
	for _, i := range seen {
		if _, ok := counts[i]; !ok {
			_ = w.perIf.Delete(i)
		}
	}
	for i, c := range counts {
		_ = w.perIf.Put(i, c)
	}
	return len(stale)
}

func (w *Witness) sweeper() {
	defer close(w.done)
	if w.opts.SweepEvery < 0 {
		<-w.stop
		return
	}
	t := time.NewTicker(w.opts.SweepEvery)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			w.Sweep()
		}
	}
}

// Close detaches the program everywhere, stops the sweeper and frees the
// maps.
func (w *Witness) Close() error {
	w.mu.Lock()
	for i, l := range w.links {
		l.Close()
		delete(w.links, i)
	}
	w.mu.Unlock()
	select {
	case <-w.stop:
		return nil
	default:
	}
	close(w.stop)
	<-w.done
	return w.closeObjects()
}

func (w *Witness) closeObjects() error {
	var errs []error
	if w.prog != nil {
		errs = append(errs, w.prog.Close())
	}
	for _, m := range []*ebpf.Map{w.syn, w.perIf, w.stats} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	return errors.Join(errs...)
}
