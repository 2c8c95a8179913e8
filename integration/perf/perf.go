//go:build linux

// Package perf measures connections the same way for kernel TCP and for
// Shunt, so that the demo, the benchmarks and docs/BENCHMARKS.md compare
// like with like: ping-pong one-way latency, streaming throughput,
// connection setup time, and CPU while idle. The far side of every
// measurement is a peer process running Serve.
package perf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// Median returns the median of ds (which it sorts).
func Median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds[len(ds)/2]
}

// Percentile returns the q-quantile (0..1) of ds (which it sorts), by the
// nearest-rank method: P99 of 1000 samples is the 990th smallest.
func Percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	i := int(q*float64(len(ds))+0.5) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

// BusyPoll wraps a kernel TCP connection so that Read spins on a
// non-blocking recv instead of parking in the netpoller: the
// "busy-polling" mode of sockperf --nonblocked, for a fair comparison with
// spinning ring readers.
type BusyPoll struct {
	*net.TCPConn
	rc syscall.RawConn
}

// NewBusyPoll wraps c.
func NewBusyPoll(c *net.TCPConn) (*BusyPoll, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &BusyPoll{TCPConn: c, rc: rc}, nil
}

// Read spins until data (or an error) arrives.
func (b *BusyPoll) Read(p []byte) (int, error) {
	var n int
	var rerr error
	err := b.rc.Read(func(fd uintptr) bool {
		for {
			n, rerr = syscall.Read(int(fd), p)
			if !errors.Is(rerr, syscall.EAGAIN) {
				return true
			}
		}
	})
	if err != nil {
		return 0, err
	}
	if rerr != nil {
		return 0, rerr
	}
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

// CPUTime returns this process's user+system CPU time.
func CPUTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ProcessCPU returns the user+system CPU time of process pid (from
// /proc/pid/stat; clock ticks of 10 ms on Linux).
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name (which is in parentheses).
	i := bytes.LastIndexByte(b, ')')
	var f [15]string
	n, _ := fmt.Sscan(string(b[i+2:]), &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7], &f[8], &f[9], &f[10], &f[11], &f[12])
	if n < 13 {
		return 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	var ut, st int64
	fmt.Sscan(f[11], &ut)
	fmt.Sscan(f[12], &st)
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

// Serve accepts connections on l and answers each one, the peer side of
// PingPong and Stream across processes: a connection whose first byte is 's'
// is a sink that reads as most programs do, io.Copy into io.Discard (8 KiB
// reads, or the connection's WriteTo), then writes the byte count as a
// line; 'r' and a 4-byte big-endian size is a sink that reads with Read
// calls of that size; any other first byte makes it an echo of size-byte
// messages. busy wraps kernel connections in BusyPoll.
func Serve(l net.Listener, size int, busy bool) error {
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		if busy {
			if c, err = NewBusyPoll(c.(*net.TCPConn)); err != nil {
				return err
			}
		}
		go serveOne(c, size)
	}
}

func serveOne(c net.Conn, size int) {
	defer c.Close()
	kind := make([]byte, 1)
	if _, err := io.ReadFull(c, kind); err != nil {
		return
	}
	switch kind[0] {
	case 's':
		n, _ := io.Copy(io.Discard, c)
		fmt.Fprintf(c, "%d\n", n)
		return
	case 'r':
		var sz [4]byte
		if _, err := io.ReadFull(c, sz[:]); err != nil {
			return
		}
		n, _ := readAll(c, int(binary.BigEndian.Uint32(sz[:])))
		fmt.Fprintf(c, "%d\n", n)
		return
	}
	buf := make([]byte, size)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

// readAll reads c to EOF with Read calls of size bytes (at most 16 MiB)
// and returns the count.
func readAll(c net.Conn, size int) (int64, error) {
	buf := make([]byte, min(max(size, 1), 16<<20))
	var n int64
	for {
		k, err := c.Read(buf)
		n += int64(k)
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// RemotePingPong measures size-byte ping-pong against a Serve peer over c
// and returns the median one-way latency over batches.
func RemotePingPong(c net.Conn, size, iters int) (time.Duration, error) {
	if _, err := c.Write([]byte{'e'}); err != nil {
		return 0, err
	}
	msg, back := make([]byte, size), make([]byte, size)
	const batches = 20
	per := max(iters/batches, 1)
	var samples []time.Duration
	for done := 0; done < iters; done += per {
		start := time.Now()
		for range per {
			if _, err := c.Write(msg); err != nil {
				return 0, err
			}
			if _, err := io.ReadFull(c, back); err != nil {
				return 0, err
			}
		}
		samples = append(samples, time.Since(start)/time.Duration(2*per))
	}
	return Median(samples), nil
}

// PingPongSamples sends n size-byte messages to a Serve echo peer over c,
// one at a time, and returns each round trip's one-way time (half the
// round trip), as sockperf does. The first message of a connection must
// be preceded by StartEcho.
func PingPongSamples(c net.Conn, size, n int) ([]time.Duration, error) {
	msg, back := make([]byte, size), make([]byte, size)
	out := make([]time.Duration, 0, n)
	for range n {
		start := time.Now()
		if _, err := c.Write(msg); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(c, back); err != nil {
			return nil, err
		}
		out = append(out, time.Since(start)/2)
	}
	return out, nil
}

// StartEcho makes a Serve peer treat c as an echo connection.
func StartEcho(c net.Conn) error {
	_, err := c.Write([]byte{'e'})
	return err
}

// RemoteStream writes total bytes in msg-byte writes to a Serve peer's sink
// over c and returns GB/s, counting only what the peer reports received.
func RemoteStream(c net.Conn, msg int, total int64) (float64, error) {
	return remoteStream(c, []byte{'s'}, msg, total)
}

// RemoteStreamSized is RemoteStream to a sink that reads with Read calls
// of readSize bytes (0: with io.Copy, as RemoteStream).
func RemoteStreamSized(c net.Conn, msg, readSize int, total int64) (float64, error) {
	if readSize == 0 {
		return RemoteStream(c, msg, total)
	}
	hdr := []byte{'r', 0, 0, 0, 0}
	binary.BigEndian.PutUint32(hdr[1:], uint32(readSize))
	return remoteStream(c, hdr, msg, total)
}

func remoteStream(c net.Conn, hdr []byte, msg int, total int64) (float64, error) {
	if _, err := c.Write(hdr); err != nil {
		return 0, err
	}
	start := time.Now()
	buf := make([]byte, msg)
	for left := total; left > 0; left -= int64(msg) {
		if _, err := c.Write(buf[:min(int64(msg), left)]); err != nil {
			return 0, err
		}
	}
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		return 0, errors.New("connection cannot half-close")
	}
	if err := cw.CloseWrite(); err != nil {
		return 0, err
	}
	var n int64
	if _, err := fmt.Fscanln(c, &n); err != nil {
		return 0, fmt.Errorf("sink's count: %w", err)
	}
	elapsed := time.Since(start)
	if n != total {
		return 0, fmt.Errorf("sink received %d bytes, want %d", n, total)
	}
	return float64(n) / elapsed.Seconds() / 1e9, nil
}

// Setup measures n connection setups against a Serve peer: dial, then one
// size-byte message there and back (so the peer has accepted and both
// sides may use the connection), then close. It returns the median.
func Setup(dial func() (net.Conn, error), n, size int) (time.Duration, error) {
	ds, err := SetupSamples(dial, n, size)
	return Median(ds), err
}

// SetupSamples is Setup returning every sample.
func SetupSamples(dial func() (net.Conn, error), n, size int) ([]time.Duration, error) {
	msg := make([]byte, 1+size)
	msg[0] = 'e'
	back := make([]byte, size)
	ds := make([]time.Duration, 0, n)
	for range n {
		start := time.Now()
		c, err := dial()
		if err != nil {
			return nil, err
		}
		if _, err := c.Write(msg); err != nil {
			c.Close()
			return nil, err
		}
		if _, err := io.ReadFull(c, back); err != nil {
			c.Close()
			return nil, err
		}
		ds = append(ds, time.Since(start))
		c.Close()
	}
	return ds, nil
}

// Listen listens on addr with one of the stacks the benchmarks compare:
// "shunt" (guestlib, the default client from the environment), or "kernel"
// and "busypoll" (plain TCP).
func Listen(stack, addr string) (net.Listener, error) {
	if stack == "shunt" {
		return guestlib.Listen("tcp4", addr)
	}
	return net.Listen("tcp4", addr)
}
