package shm_test

import (
	"bufio"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// The tests re-execute the test binary as the peer process. The child finds
// its role and parameters in SHUNT_CHILD_* variables and the region as fd 3.

func TestMain(m *testing.M) {
	if role := os.Getenv("SHUNT_CHILD_ROLE"); role != "" {
		if err := child(role); err != nil {
			fmt.Fprintf(os.Stderr, "child %s: %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	before := openFDs()
	code := m.Run()
	if after := openFDs(); code == 0 && after > before {
		fmt.Fprintf(os.Stderr, "fd leak: %d open fds before the tests, %d after\n", before, after)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goroutine leak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// openFDs counts this process's open file descriptors, except the Go
// runtime's own netpoller (an epoll fd and an eventfd, made once on first use).
func openFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, e := range ents {
		l, _ := os.Readlink("/proc/self/fd/" + e.Name())
		if l != "anon_inode:[eventpoll]" && l != "anon_inode:[eventfd]" {
			n++
		}
	}
	return n
}

func envInt(name string) int {
	v, _ := strconv.Atoi(os.Getenv(name))
	return v
}

// peer is the child's view: the region from fd 3, its rings, its policy.
type peer struct {
	reg    *region.Region
	rd     *ring.Reader // AB: parent -> child
	w      *ring.Writer // BA: child -> parent
	policy *wait.Policy
}

func openPeer() (*peer, error) {
	f := os.NewFile(3, "region")
	defer f.Close()
	reg, err := region.OpenFile(f)
	if err != nil {
		return nil, err
	}
	mode, err := wait.ParseMode(os.Getenv("SHUNT_CHILD_MODE"))
	if err != nil {
		return nil, err
	}
	p := &peer{reg: reg, policy: &wait.Policy{Mode: mode}}
	gen, _ := strconv.ParseUint(os.Getenv("SHUNT_CHILD_GEN"), 10, 64)
	ab, ba, err := reg.Rings(envInt("SHUNT_CHILD_SLOT"), gen)
	if err != nil {
		return nil, err
	}
	if p.rd, err = ring.NewReader(ab, p.policy); err != nil {
		return nil, err
	}
	if p.w, err = ring.NewWriter(ba, p.policy); err != nil {
		return nil, err
	}
	return p, nil
}

func child(role string) error {
	if role == "atomic" {
		return atomicPong()
	}
	p, err := openPeer()
	if err != nil {
		return err
	}
	size := envInt("SHUNT_CHILD_SIZE")
	switch role {
	case "writer": // stream seeded random bytes, print the checksum
		rng := rand.NewChaCha8([32]byte{byte(envInt("SHUNT_CHILD_SEED"))})
		sizes := rand.New(rand.NewPCG(uint64(envInt("SHUNT_CHILD_SEED")), 9))
		buf := make([]byte, 1<<20)
		var sum uint32
		for left := size; left > 0; {
			k := min(left, 1+sizes.IntN(len(buf)))
			rng.Read(buf[:k])
			sum = crc32.Update(sum, crc32.IEEETable, buf[:k])
			if _, err := p.w.Write(buf[:k]); err != nil {
				return err
			}
			left -= k
		}
		fmt.Printf("crc %d\n", sum)
		return p.w.CloseWrite()
	case "echo": // read size bytes, send them back, until EOF
		buf := make([]byte, size)
		for {
			if _, err := io.ReadFull(p.rd, buf); err == io.EOF {
				return nil
			} else if err != nil {
				return err
			}
			if _, err := p.w.Write(buf); err != nil {
				return err
			}
		}
	case "sink", "sink-zc": // consume until EOF, then say how much
		var n int
		var fold uint64
		buf := make([]byte, size)
		if rs := envInt("SHUNT_CHILD_RSIZE"); rs > 0 {
			buf = make([]byte, rs)
		}
		for {
			var k int
			var err error
			if role == "sink" {
				k, err = p.rd.Read(buf)
			} else {
				var b []byte
				if b, err = p.rd.Peek(size); err == nil {
					fold += touch(b)
					k = len(b)
					err = p.rd.Release(k)
				}
			}
			n += k
			if err == io.EOF {
				break
			}
			if err != nil {
				return err
			}
		}
		_, err := p.w.Write([]byte(fmt.Sprintf("%d %d\n", n, fold&1)))
		return err
	case "idle": // wait on an idle ring, report CPU used while waiting
		var before, after syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &before)
		start := time.Now()
		if _, err := p.rd.Read(make([]byte, 1)); err != nil {
			return err
		}
		wall := time.Since(start)
		syscall.Getrusage(syscall.RUSAGE_SELF, &after)
		cpu := time.Duration(after.Utime.Nano()+after.Stime.Nano()-before.Utime.Nano()-before.Stime.Nano()) * time.Nanosecond
		fmt.Printf("cpu %d wall %d\n", cpu, wall)
		return nil
	}
	return fmt.Errorf("unknown role %q", role)
}

// touch reads one word per cache line, so a zero-copy reader really pulls
// every line of the data into its cache.
func touch(b []byte) uint64 {
	var s uint64
	for i := 0; i < len(b); i += 64 {
		s += uint64(b[i])
	}
	return s
}

// atomicPong is the physical floor: bare ping-pong on one shared word.
func atomicPong() error {
	f := os.NewFile(3, "word")
	mem, err := sys.Map(f, 4096)
	if err != nil {
		return err
	}
	w := (*atomic.Uint64)(unsafe.Pointer(&mem[0]))
	for {
		v := w.Load()
		if v == ^uint64(0) {
			return nil
		}
		if v%2 == 1 {
			w.Store(v + 1)
		}
	}
}

// flow is the parent's side of one ring pair shared with a child process.
type flow struct {
	pool *region.Pool
	slot int
	gen  uint64
	w    *ring.Writer
	rd   *ring.Reader
	cmd  *exec.Cmd
	out  *bufio.Reader
}

// startPeer allocates a flow with rings of capacity c in a fresh memfd
// region, and starts the child with role and size; policy is for both sides.
func startPeer(t testing.TB, role string, c, size int, mode wait.Mode, extra ...string) *flow {
	t.Helper()
	reg, f := shmtest.Region(t, region.Geometry{Size: 4*region.PairSize(c) + 64<<10, Slots: 4})
	pool := region.NewPool(reg, nil)
	slot, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: c})
	if err != nil {
		t.Fatal(err)
	}
	ab, ba, err := reg.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	pol := &wait.Policy{Mode: mode}
	fl := &flow{pool: pool, slot: slot, gen: e.Gen}
	fl.w, _ = ring.NewWriter(ab, pol)
	fl.rd, _ = ring.NewReader(ba, pol)
	fl.cmd = exec.Command(os.Args[0], "-test.run=^$")
	fl.cmd.Env = append(os.Environ(),
		"SHUNT_CHILD_ROLE="+role, "SHUNT_CHILD_MODE="+mode.String(),
		fmt.Sprintf("SHUNT_CHILD_SLOT=%d", slot), fmt.Sprintf("SHUNT_CHILD_GEN=%d", e.Gen),
		fmt.Sprintf("SHUNT_CHILD_SIZE=%d", size))
	fl.cmd.Env = append(fl.cmd.Env, extra...)
	fl.cmd.ExtraFiles = []*os.File{f}
	fl.cmd.Stderr = os.Stderr
	stdout, err := fl.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	fl.out = bufio.NewReader(stdout)
	if err := fl.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		fl.w.CloseWrite()
		done := make(chan struct{})
		go func() { fl.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			fl.cmd.Process.Kill()
			<-done
		}
	})
	return fl
}

// TestCrossProcessStream moves 1 GiB of seeded random bytes in random-sized
// writes from a child process through a 256 KiB ring and compares checksums.
func TestCrossProcessStream(t *testing.T) {
	total := 1 << 30
	if testing.Short() {
		total = 64 << 20
	}
	seed := int(time.Now().UnixNano() % 256)
	t.Logf("seed %d", seed)
	fl := startPeer(t, "writer", 256<<10, total, wait.Adaptive, fmt.Sprintf("SHUNT_CHILD_SEED=%d", seed))
	var sum uint32
	var n int
	buf := make([]byte, 1<<20)
	sizes := rand.New(rand.NewPCG(uint64(seed), 3))
	for {
		k, err := fl.rd.Read(buf[:1+sizes.IntN(len(buf))])
		sum = crc32.Update(sum, crc32.IEEETable, buf[:k])
		n += k
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("read after %d bytes: %v", n, err)
		}
	}
	line, err := fl.out.ReadString('\n')
	if err != nil {
		t.Fatalf("child's checksum: %v", err)
	}
	want, _ := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(line), "crc "), 10, 32)
	if n != total || sum != uint32(want) {
		t.Fatalf("got %d bytes crc %d, want %d crc %d", n, sum, total, want)
	}
}

// TestPeerDiesMidTransfer: the writer process is killed mid-stream; hostd
// (the pool) revokes the flow, and the blocked reader fails with ErrReset
// instead of hanging.
func TestPeerDiesMidTransfer(t *testing.T) {
	fl := startPeer(t, "writer", 64<<10, 1<<40, wait.Adaptive)
	if _, err := io.ReadFull(fl.rd, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	fl.cmd.Process.Kill()
	fl.cmd.Wait()
	// Drain what the writer left, then the reader blocks until the abort.
	errc := make(chan error, 1)
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := fl.rd.Read(buf); err != nil {
				errc <- err
				return
			}
		}
	}()
	// What hostd does when it learns the guest died.
	if err := fl.pool.Revoke(fl.slot, fl.gen, 9); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err != ring.ErrReset {
			t.Fatalf("read after peer death = %v, want ErrReset", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("reader hung after the peer died and the flow was revoked")
	}
}
