package guestlib

import (
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// BenchmarkConnCall: the library's own cost per Write and per Read on
// the rings, with nothing to wait for: one goroutine writes size bytes
// and reads them back through a connection of two Clients of this
// process (guesttest's hostd). Cross-process figures, against C and the
// kernel: BenchmarkGuestSizes (make bench-sizes).
func BenchmarkConnCall(b *testing.B) {
	for _, size := range []int{64, 1 << 10, 8 << 10, 32 << 10} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			p := newPair(b)
			c, s := p.conns(b)
			defer c.Close()
			defer s.Close()
			waitFor(b, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
			buf := make([]byte, size)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(s, buf); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/call")
		})
	}
}

// BenchmarkConnStream: a one-way stream from another process (the test
// binary again, TestStreamWriterProcess) through 1 MiB rings (hostd's
// default) and guesttest's hostd: 64 KiB Writes there, Reads of size
// bytes here, as the read=N rows of BenchmarkGuestSizes without the
// network namespaces; +crc rows take a CRC-32 of each read, a reader
// slower than its writer (as in the namespaces' runs, where 4 KiB reads
// ran at 5 GB/s). ns/read is the reader's time per call, its waits for
// the writer included; cpu/wall the reader process's CPU (all its
// threads) over the time; wsleeps/MiB the writing thread's sleeps
// (voluntary context switches) per MiB.
func BenchmarkConnStream(b *testing.B) {
	for _, size := range []int{1 << 10, 4 << 10, 8 << 10, 64 << 10} {
		for _, crc := range []bool{false, true} {
			name := fmt.Sprintf("read=%d", size)
			if crc {
				name += "+crc"
			}
			b.Run(name, func(b *testing.B) { benchStream(b, size, crc) })
		}
	}
}

func benchStream(b *testing.B, size int, crc bool) {
	p := newPairCapacity(b, 1<<20)
	h := p.dialer.opts
	total := int64(b.N+1) * int64(size)
	cmd := exec.Command(os.Args[0], "-test.run=^TestStreamWriterProcess$")
	cmd.Env = append(os.Environ(), "GUESTLIB_STREAM="+strings.Join([]string{h.Control, h.Region, p.l.Addr().String(), strconv.FormatInt(total, 10)}, ","))
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	waited := false
	defer func() {
		if !waited {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	s, err := p.l.AcceptShunt()
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	buf := make([]byte, size)
	got, calls := int64(0), 0
	var cpu0 time.Duration
	var sum uint32
	for got < total {
		n, err := s.Read(buf)
		if err != nil {
			b.Fatalf("read at %d of %d: %v (writer: %s)", got, total, err, out.String())
		}
		if crc {
			sum = crc32.Update(sum, crc32.IEEETable, buf[:n])
		}
		if got == 0 {
			if !s.Stats().ReadOnRing {
				b.Fatalf("the first byte came over TCP: %+v", s.Stats())
			}
			b.SetBytes(int64(size))
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 = cpuTime(b)
		} else {
			calls++
		}
		got += int64(n)
	}
	b.StopTimer()
	cpu := cpuTime(b) - cpu0
	waited = true
	if err := cmd.Wait(); err != nil {
		b.Fatalf("writer: %v\n%s", err, out.String())
	}
	if tcp := s.Stats().TCPReceived; tcp != 0 {
		b.Fatalf("%d bytes came over TCP", tcp)
	}
	var sleeps float64
	if _, err := fmt.Sscanf(out.String()[strings.LastIndex(out.String(), "nvcsw "):], "nvcsw %g", &sleeps); err != nil {
		b.Fatalf("the writer's count of sleeps: %v\n%s", err, out.String())
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(calls), "ns/read")
	b.ReportMetric(float64(got-int64(size))/b.Elapsed().Seconds()/1e9, "GB/s")
	b.ReportMetric(float64(cpu)/float64(b.Elapsed()), "cpu/wall")
	b.ReportMetric(sleeps/float64(got>>20), "wsleeps/MiB")
}

// TestStreamWriterProcess is BenchmarkConnStream's writer, in a process
// of its own; it runs only when the benchmark starts it
// (GUESTLIB_STREAM=control,region,addr,total).
func TestStreamWriterProcess(t *testing.T) {
	arg := strings.Split(os.Getenv("GUESTLIB_STREAM"), ",")
	if len(arg) != 4 {
		t.Skip("BenchmarkConnStream's writer; the benchmark starts it")
	}
	total, err := strconv.ParseInt(arg[3], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread() // the Writes' waits are this thread's (rusageThread)
	cl, err := NewClient(Options{Control: arg[0], Region: arg[1]})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	cl.loopback = true
	c, err := (&Dialer{Client: cl}).DialContext(context.Background(), "tcp4", arg[2])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast })
	const chunk = 64 << 10
	buf := make([]byte, chunk)
	for left := total; left > 0; left -= chunk {
		if _, err := c.Write(buf[:min(chunk, left)]); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.TCPSent != 0 {
		t.Fatalf("%d bytes went over TCP: %+v", st.TCPSent, st)
	}
	var ru syscall.Rusage // of the writing thread: its futex sleeps, not the runtime's
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("nvcsw %d\n", ru.Nvcsw)
}

// rusageThread is RUSAGE_THREAD (Linux), which package syscall does not name.
const rusageThread = 1
