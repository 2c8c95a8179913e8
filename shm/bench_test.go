package shm_test

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// Cross-process benchmarks: the parent is one end, a child process the
// other, sharing a memfd region. Run with `make bench-shm`; the table in
// docs/BENCHMARKS.md comes from that command.

var sizes = []int{8, 64, 4 << 10, 64 << 10}

// BenchmarkAtomicPingPong is the physical floor: two processes handing one
// shared word back and forth, no ring at all.
func BenchmarkAtomicPingPong(b *testing.B) {
	f := shmtest.Memfd(b, 4096)
	mem, err := sys.Map(f, 4096)
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Unmap(mem)
	w := (*atomic.Uint64)(unsafe.Pointer(&mem[0]))
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SHUNT_CHILD_ROLE=atomic")
	cmd.ExtraFiles = []*os.File{f}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer cmd.Wait()
	var v uint64
	for b.Loop() {
		v += 2
		w.Store(v - 1)
		for w.Load() != v {
		}
	}
	w.Store(^uint64(0))
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/oneway")
}

// BenchmarkPingPong: one message of each size there and back through the
// rings; the figure is half the round trip.
func BenchmarkPingPong(b *testing.B) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Adaptive} {
		for _, size := range sizes {
			b.Run(fmt.Sprintf("%s/%s", mode, human(size)), func(b *testing.B) {
				fl := startPeer(b, "echo", 256<<10, size, mode)
				msg := make([]byte, size)
				back := make([]byte, size)
				b.SetBytes(int64(size))
				for b.Loop() {
					if _, err := fl.w.Write(msg); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(fl.rd, back); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/oneway")
			})
		}
	}
}

// BenchmarkStream: one direction, messages of each size, through 1 MiB
// rings; the child consumes with the copy API (Read) or in place
// (Peek/Release, touching every cache line).
func BenchmarkStream(b *testing.B) {
	for _, api := range []string{"copy", "zerocopy"} {
		for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/%s", api, human(size)), func(b *testing.B) {
				stream(b, api, 1<<20, size)
			})
		}
	}
}

// BenchmarkStreamReadSize: 64 KiB writes through a 1 MiB ring, the child
// reading with Read calls of each size.
func BenchmarkStreamReadSize(b *testing.B) {
	for _, rs := range []int{1 << 10, 4 << 10, 8 << 10, 64 << 10} {
		b.Run(human(rs), func(b *testing.B) {
			stream(b, "copy", 1<<20, 64<<10, fmt.Sprintf("SHUNT_CHILD_RSIZE=%d", rs))
		})
	}
}

// BenchmarkRingSize is the buffer-management comparison: the same 64 KiB
// stream through rings of each capacity. A pool that sizes rings per flow
// can pick the knee of this curve; fixed per-slot rings must pick one size
// for every flow.
func BenchmarkRingSize(b *testing.B) {
	for _, msg := range []int{64 << 10, 1 << 20} {
		for _, c := range []int{64 << 10, 256 << 10, 1 << 20, 4 << 20} {
			b.Run(fmt.Sprintf("msg%s/ring%s", human(msg), human(c)), func(b *testing.B) { stream(b, "copy", c, msg) })
		}
	}
}

func stream(b *testing.B, api string, capacity, size int, extra ...string) {
	role := "sink"
	if api == "zerocopy" {
		role = "sink-zc"
	}
	fl := startPeer(b, role, capacity, size, wait.Adaptive, extra...)
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	b.SetBytes(int64(size))
	for b.Loop() {
		if api == "copy" {
			if _, err := fl.w.Write(src); err != nil {
				b.Fatal(err)
			}
			continue
		}
		for off := 0; off < size; {
			buf, err := fl.w.Reserve(size - off)
			if err != nil {
				b.Fatal(err)
			}
			copy(buf, src[off:])
			fl.w.Commit(len(buf))
			off += len(buf)
		}
	}
	// The figure counts only bytes the child consumed: wait for its report.
	fl.w.CloseWrite()
	line := make([]byte, 64)
	n, err := fl.rd.Read(line)
	if err != nil {
		b.Fatal(err)
	}
	var got, fold int
	fmt.Sscanf(string(line[:n]), "%d %d", &got, &fold)
	if got != b.N*size {
		b.Fatalf("child consumed %d bytes, want %d", got, b.N*size)
	}
	b.ReportMetric(float64(got)/b.Elapsed().Seconds()/1e9, "GB/s")
}

// BenchmarkIdleCPU: the child waits 300 ms on an idle ring in each mode and
// reports the CPU it burnt, as a percentage of one core.
func BenchmarkIdleCPU(b *testing.B) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Adaptive, wait.Block} {
		b.Run(mode.String(), func(b *testing.B) {
			var pct []float64
			for b.Loop() {
				fl := startPeer(b, "idle", 64<<10, 0, mode)
				time.Sleep(300 * time.Millisecond)
				fl.w.Write([]byte{1})
				line, err := fl.out.ReadString('\n')
				if err != nil {
					b.Fatal(err)
				}
				var cpu, wall int64
				fmt.Sscanf(strings.TrimSpace(line), "cpu %d wall %d", &cpu, &wall)
				pct = append(pct, 100*float64(cpu)/float64(wall))
			}
			sort.Float64s(pct)
			b.ReportMetric(pct[len(pct)/2], "%core")
		})
	}
}

func human(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}
